"""Hugging Face Transformers front end: ``ZeroTrainer``, the ``Trainer`` on a ZeroAccelerator.

::

    from zero_strategy.transformers import ZeroTrainer, zero_trainer  # before building TrainingArguments

    trainer = ZeroTrainer(model=model, args=TrainingArguments(...), train_dataset=ds, zero_config="zero3")
    trainer.train()                                    # checkpoint-N/ holds every rank's shard
    ZeroTrainer(...).train(resume_from_checkpoint=True)

    trainer = zero_trainer(SFTTrainer)(model=model, args=SFTConfig(...), train_dataset=ds, zero_config="zero3")

    model = from_pretrained(AutoModelForCausalLM, path, dtype=torch.bfloat16)  # weights read sharded at setup

[Note: importing first]
``TrainingArguments(...)`` sets up Accelerate's process state as it is built. Under
``accelerate launch`` with several processes on a machine without GPUs that state
must know it runs on CPU (see ``zero_strategy.accelerate._launch``), so importing this
module sets ``ACCELERATE_USE_CPU=true`` in exactly that case; otherwise pass
``TrainingArguments(use_cpu=True)``. Likewise a DEEPSPEED accelerate launch is adopted
here, before ``TrainingArguments`` would start DeepSpeed (see [Note: adopting a
DeepSpeed launch] there). The engine never imports transformers.
"""

from ..accelerate._launch import adopt_deepspeed_launch as _adopt_deepspeed_launch
from ..accelerate._launch import use_cpu_if_no_device as _use_cpu_if_no_device

_adopt_deepspeed_launch()
_use_cpu_if_no_device(False)

from ._mixin import ZeroTrainerMixin, zero_trainer  # noqa: E402
from ._pretrained import from_pretrained  # noqa: E402
from ._trainer import ZERO_CHECKPOINT_DIR, ZeroTrainer  # noqa: E402

__all__ = ["ZeroTrainer", "ZeroTrainerMixin", "zero_trainer", "ZERO_CHECKPOINT_DIR", "from_pretrained"]
