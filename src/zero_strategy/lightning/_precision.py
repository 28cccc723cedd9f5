"""Precision plugins that hand numerics to the ZeRO engine.

[Note: why Lightning's own plugins do not fit]
The engine keeps fp32 master shards and casts the parameters themselves to the
compute dtype (bf16/fp16); forward inputs are cast by the engine's root hook. So
there is nothing for autocast to do (``forward_context`` is a no-op), modules must
not be converted by the plugin (the engine does it, after sharding), and fp16 loss
scaling belongs to the ZeroOptimizer, whose overflow check spans all ranks. A
``GradScaler`` would unscale per rank and step the user's optimizer directly.
Clipping by norm must use the norm over all shards, which only the ZeroOptimizer
knows; clipping by value clamps the unscaled shards (ZeroOptimizer.clip_grad_value_). The strategies replace whatever generic plugin Lightning picks for
"32-true" / "bf16-mixed" / "16-mixed" / "bf16-true" with these.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ._config import LIGHTNING_PRECISION
from ._optimizers import zero_optimizer_of


def check_precision_flag(precision: str) -> str:
    precision = str(precision)
    if precision not in LIGHTNING_PRECISION:
        raise ValueError(f"zero_strategy does not support precision={precision!r}; use '32-true', "
                         "'bf16-mixed', 'bf16-true', '16-mixed' or '16-true'")
    return precision


class _ZeroNumerics:
    """What both plugins share: the ZeroOptimizer that scales losses, set by the strategy."""

    precision: str
    zero_optimizer = None  # the ZeroOptimizer owning the loss scale; None before setup / without optimizer

    def _scale(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.zero_optimizer.scale_loss(tensor) if self.zero_optimizer is not None else tensor

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # the engine casts parameters to the compute dtype when it shards them

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # fp32 at init: the masters are made from these values

    def module_init_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # parameters already are in the compute dtype: no autocast

    def convert_input(self, data: Any) -> Any:
        return data  # the engine's root hook casts floating inputs

    def convert_output(self, data: Any) -> Any:
        return data

    def state_dict(self) -> dict:
        return {}  # the loss scale is saved with the sharded checkpoint


class ZeroFabricPrecision(_ZeroNumerics, FabricPrecision):
    """Fabric: ``fabric.backward`` scales the loss through the ZeroOptimizer."""

    def __init__(self, precision: str = "32-true"):
        self.precision = check_precision_flag(precision)

    def backward(self, tensor: torch.Tensor, model: Optional[torch.nn.Module], *args: Any, **kwargs: Any) -> None:
        self._scale(tensor).backward(*args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        return optimizer.step(**kwargs)

    def unscale_gradients(self, optimizer) -> None:
        return None  # the ZeroOptimizer unscales inside clip_grad_norm_ / step


class ZeroPrecision(_ZeroNumerics, Precision):
    """Trainer: loss scaling, global-norm clipping and a closure-first optimizer step."""

    def __init__(self, precision: str = "32-true"):
        self.precision = check_precision_flag(precision)

    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        model.backward(self._scale(tensor), *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure (forward + backward + clipping hooks), then step; ZeroOptimizer takes no closure."""
        closure_result = closure()
        skipped_backward = closure_result is None
        automatic = getattr(model, "automatic_optimization", True)
        if automatic and skipped_backward:
            return closure_result  # training_step returned None: no clipping, no step (as with AMP)
        self._after_closure(model, optimizer)
        return optimizer.step(**kwargs)

    def clip_gradients(self, optimizer, clip_val: float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.clip_grad_by_value(optimizer, clip_val)
        else:
            self.clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        _zero_optimizer(optimizer).clip_grad_norm_(clip_val)

    def clip_grad_by_value(self, optimizer, clip_val: float) -> None:
        """Elementwise on each rank's unscaled gradient shard: exact, the same as on the whole model."""
        _zero_optimizer(optimizer).clip_grad_value_(clip_val)


def _zero_optimizer(optimizer):
    zopt = zero_optimizer_of(optimizer)  # behind the LightningOptimizer
    if zopt is None:
        raise MisconfigurationException("zero_strategy: clipping needs the optimizer set up by ZeroStrategy")
    return zopt
