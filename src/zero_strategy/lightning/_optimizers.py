"""Zero, one or several optimizers -> ``zero_strategy.setup``; finding our optimizer behind Lightning's wrappers.

Several optimizers over disjoint parameters (a GAN's generator and discriminator,
manual optimization) are one engine setup: ``setup(model, [opt_g, opt_d])`` returns
one ZeroOptimizer each, stepping, clipping and zeroing only its own shards.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import api as zs_api
from .._optim.optimizer import ZeroOptimizer


def setup_model_and_optimizers(model: torch.nn.Module, optimizers: list, config, device=None,
                               param_init_fn=None) -> list[ZeroOptimizer]:
    """Shard ``model`` in place; return the ZeroOptimizers in the given order (``[]`` without optimizers)."""
    kwargs: dict[str, Any] = {}
    if device is not None:
        kwargs["device"] = device
    if param_init_fn is not None:
        kwargs["param_init_fn"] = param_init_fn
    _, zopts = zs_api.setup(model, list(optimizers), config, **kwargs)
    return list(zopts)


def is_set_up(module: torch.nn.Module) -> bool:
    """Whether ``module`` is sharded by a live engine (``zero_strategy.setup`` and no teardown since)."""
    return zs_api.is_set_up(module)


def loss_scaler_of(zero_optimizers: list[ZeroOptimizer], precision: str) -> Optional[ZeroOptimizer]:
    """The ZeroOptimizer whose loss scale ``backward`` applies.

    fp16 keeps one dynamic loss scale per optimizer; a backward through Lightning
    (``manual_backward(loss)``) does not say which optimizer it is for, so fp16 with
    several optimizers is refused instead of unscaling with the wrong factor.
    """
    if not zero_optimizers:
        return None
    if precision == "fp16" and len(zero_optimizers) > 1:
        raise ValueError("zero_strategy: precision '16-mixed' with several optimizers is not supported (each "
                         "optimizer has its own loss scale and a backward does not say which one applies); "
                         "use 'bf16-mixed' or '32-true'")
    return zero_optimizers[0]


def zero_optimizer_of(optimizer) -> Optional[ZeroOptimizer]:
    """The ZeroOptimizer behind whatever Lightning hands us (LightningOptimizer, _FabricOptimizer)."""
    for _ in range(4):
        if optimizer is None or isinstance(optimizer, ZeroOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "_optimizer", None) or getattr(optimizer, "optimizer", None)
    return None
