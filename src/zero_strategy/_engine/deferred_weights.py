"""Pretrained weights a meta-built model gets when it is set up, each rank its own slices.

The registry ``setup`` consults (See [Note: weights that arrive at setup]); the loaders that
fill it are above this layer (``zero_strategy.transformers.from_pretrained``), and so is
the code that reads checkpoints, which each record carries as its ``fill``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from .materialize import default_init

__all__ = ["DeferredWeights", "defer_weights", "pending_weights", "init_for_pending", "load_deferred_weights",
           "loaded_whole"]


@dataclass
class DeferredWeights:
    """Weights a meta-built model is to get from ``read`` when it is set up (``defer_weights``).

    ``init(model, module)`` initializes the modules first (what no source entry covers keeps
    that value, as ``from_pretrained`` leaves a new head initialized); ``loaded(missing)``
    hears which parameters the source lacked. ``init`` takes the model as an argument so this
    record, held beside the model in a weak table, never keeps it alive.
    """
    read: Callable[[list[str], int, int], "torch.Tensor | None"]
    #: fill(model, read) -> missing names: writes this rank's shards (checkpoint.load_sharded_weights,
    #: given by the loader: this layer sits below the checkpoint code it runs)
    fill: Callable[[torch.nn.Module, Callable], list[str]]
    init: Callable[[torch.nn.Module, torch.nn.Module], object] | None = None
    loaded: Callable[[list[str]], None] | None = None


_DEFERRED: "weakref.WeakKeyDictionary[torch.nn.Module, DeferredWeights]" = weakref.WeakKeyDictionary()


def defer_weights(model: torch.nn.Module, weights: DeferredWeights) -> None:
    """Have ``setup(model, ...)`` (any front end's) fill ``model``'s shards from ``weights``.

    [Note: weights that arrive at setup]
    A model built on the meta device cannot hold its pretrained weights before it is
    sharded: only the engine knows which slice of each parameter this rank keeps. So a
    loader (``zero_strategy.transformers.from_pretrained``) builds the model empty and
    records its source here; ``setup`` materializes it unit by unit with ``weights.init``
    and then reads this rank's slices from the source (``weights.fill``: the checkpoint
    code's ``load_sharded_weights``). The
    front ends all set up through ``setup``, so ZeroTrainer, Accelerate's ``prepare``,
    Lightning and Fabric load such a model sharded with no call of their own.
    """
    _DEFERRED[model] = weights


def pending_weights(model: torch.nn.Module) -> list[tuple[str, DeferredWeights]]:
    """(module name, its deferred weights) for ``model`` and every submodule that has some: a
    LightningModule whose ``configure_model`` assigned ``self.model = from_pretrained(...)``
    is set up as the root, its Hugging Face model one level down."""
    return [(name, w) for name, m in model.named_modules() if (w := _DEFERRED.get(m)) is not None]


def init_for_pending(model: torch.nn.Module, pending: list[tuple[str, DeferredWeights]]):
    """A ``param_init_fn`` for ``setup``: each module by the loader that built it (its model's
    own initialization), any other module by its ``reset_parameters()``."""
    if not any(w.init is not None for _, w in pending):
        return None
    owner = {}
    for name, w in pending:
        sub = model.get_submodule(name)
        owner.update({id(m): (sub, w) for m in sub.modules()})

    def init(module: torch.nn.Module) -> None:
        sub, w = owner.get(id(module), (None, None))
        if w is not None and w.init is not None:
            w.init(sub, module)
        elif not default_init(module) and any(p.is_meta for p in module.parameters(recurse=False)):
            raise ValueError(f"zero_strategy.setup: {type(module).__name__} has meta-device parameters, no "
                             "reset_parameters() and no pretrained loader; pass param_init_fn=fn to setup")
    return init


def loaded_whole(model: torch.nn.Module, pending: list[tuple[str, DeferredWeights]],
                 opaque: frozenset[int] = frozenset()) -> frozenset[int]:
    """Ids of the meta parameters of ``model`` the pending sources hold, by any of their names (their
    readers' ``shape_of``; none where a reader cannot tell): the load writes each of their elements,
    so setup need not initialize them. A source whose shape differs is refused by the load itself.
    Floating parameters, and the ``opaque`` ones (a 4-bit base's packed codes, uint8 too), which
    the flat groups hold and the load fills."""
    if not pending:
        return frozenset()
    reader = _PrefixedReader(sorted(((f"{n}." if n else "", w) for n, w in pending), key=lambda pw: -len(pw[0])))
    shape_of = getattr(reader, "shape_of", None)
    if shape_of is None:
        return frozenset()
    names: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return frozenset(pid for pid, n in names.items()
                     if params[pid].is_meta and (params[pid].is_floating_point() or pid in opaque)
                     and shape_of(n) is not None)


def load_deferred_weights(model: torch.nn.Module) -> None:
    """Fill a set-up model from the sources ``defer_weights`` recorded on it or its submodules (once)."""
    pending = pending_weights(model)
    if not pending:
        return
    for name, _ in pending:
        _DEFERRED.pop(model.get_submodule(name), None)
    by_prefix = sorted(((f"{name}." if name else "", w) for name, w in pending), key=lambda pw: -len(pw[0]))
    missing = by_prefix[0][1].fill(model, _PrefixedReader(by_prefix))
    for prefix, w in by_prefix:
        if w.loaded is not None:
            w.loaded([m[len(prefix):] for m in missing if m.startswith(prefix)])


class _PrefixedReader:
    """The readers of several loaders as one, each for the names under its module's prefix. It has
    ``shape_of`` (the shapes the checkpoint code compares before copying) where all of them do."""

    def __init__(self, by_prefix: list[tuple[str, DeferredWeights]]):
        self.by_prefix = by_prefix
        if all(callable(getattr(w.read, "shape_of", None)) for _, w in by_prefix):
            self.shape_of = lambda names: self._ask(names, lambda read, own: read.shape_of(own))

    def _ask(self, names: list[str], ask):
        for prefix, w in self.by_prefix:
            own = [n[len(prefix):] for n in names if n.startswith(prefix)]
            if own:
                return ask(w.read, own)
        return None

    def __call__(self, names: list[str], start: int, end: int):
        return self._ask(names, lambda read, own: read(own, start, end))
