"""ModelSummary with the true parameter counts of a sharded model.

Stage 3 parameters are empty tensors outside forward, so Lightning's summary would
count zero. Counts come from the engine's slots (the unsharded shape of each
parameter). Lightning picks its summary class in ``ModelSummary._summary`` and
offers no strategy hook for it (it special-cases DeepSpeed there), so the strategy
points that method of the summary callbacks at :func:`summarize`.
"""

from __future__ import annotations

import types
from collections import OrderedDict

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary, ModelSummary

from ..api import full_shapes


def true_numels(model) -> dict[int, int]:
    """id(parameter) -> its number of elements in the unsharded model."""
    try:
        shapes = full_shapes(model)
    except ValueError:
        return {}
    return {id(p): int(shape.numel()) for p, shape in shapes.items()}


def _count(params, numels: dict[int, int]) -> int:
    return sum(numels.get(id(p), p.numel()) for p in params)


class _ZeroLayerSummary(LayerSummary):
    def __init__(self, module, numels: dict[int, int]):
        super().__init__(module)
        self._numels = numels

    @property
    def num_parameters(self) -> int:
        return _count(self._module.parameters(), self._numels)


class ZeroModelSummary(ModelSummary):
    """Lightning's ModelSummary counting the parameters of the unsharded model."""

    def __init__(self, model, max_depth: int = 1):
        self._numels = true_numels(model)
        super().__init__(model, max_depth=max_depth)

    def summarize(self):
        summary = OrderedDict((name, _ZeroLayerSummary(module, self._numels)) for name, module in self.named_modules)
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for k in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[k]
        return summary

    @property
    def total_parameters(self) -> int:
        return _count(self._model.parameters(), self._numels)

    @property
    def trainable_parameters(self) -> int:
        return _count((p for p in self._model.parameters() if p.requires_grad), self._numels)


def summarize(model, max_depth: int = 1) -> ZeroModelSummary:
    return ZeroModelSummary(model, max_depth=max_depth)


def install(trainer) -> None:
    """Make the trainer's summary callbacks use :class:`ZeroModelSummary`."""
    for cb in trainer.callbacks:
        if isinstance(cb, ModelSummaryCallback):
            cb._summary = types.MethodType(lambda self, trainer, pl_module: summarize(
                pl_module, max_depth=self._max_depth), cb)
