"""Hugging Face Accelerate front end: ``ZeroAccelerator``, an ``Accelerator`` that shards with ZeRO.

::

    from zero_strategy.accelerate import ZeroAccelerator

    accelerator = ZeroAccelerator(zero_config="zero3", gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

Launch with ``accelerate launch --config_file recipes/accelerate/<config>.yaml train.py``
(a MULTI_GPU-type config), or keep a DeepSpeed user's DEEPSPEED accelerate config
unchanged: ``from zero_strategy.accelerate import Accelerator`` (the same class under
Accelerate's name) is then the only change, and the config's ds_config is the ZeRO
config. The engine itself never imports Accelerate: this package only translates.
"""

from ._accelerator import ZeroAccelerator, ZeroModelRecord
from ._config import DEFAULT_PRESET, ENV_VAR
from ._optimizer import ZeroAcceleratedOptimizer

#: ``from zero_strategy.accelerate import Accelerator``: the one-line switch from ``accelerate.Accelerator``
Accelerator = ZeroAccelerator

__all__ = ["Accelerator", "ZeroAccelerator", "ZeroAcceleratedOptimizer", "ZeroModelRecord", "DEFAULT_PRESET",
           "ENV_VAR"]
