"""Load full-model weights into a set-up model, each rank reading only its own slices.

A pretrained model directory (Hugging Face safetensors, one file or sharded with an
index) holds every parameter whole. Under ZeRO each rank owns a contiguous slice of
each flat group; ``load_sharded_weights`` asks a reader for exactly the elements of
that slice, parameter by parameter, so no rank ever materializes the full model,
and then rebuilds the compute-dtype parameters as after an optimizer step.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..api import engine_of
from ._layout import CheckpointError, param_names
from ._load import _publish

#: read(names, start, end) -> 1-D tensor of the flattened parameter's elements [start, end)
#: for the first of ``names`` the source has, or None if it has none of them
SliceReader = Callable[[list[str], int, int], "torch.Tensor | None"]


@torch.no_grad()
def load_sharded_weights(model: torch.nn.Module, read: SliceReader, strict: bool = True) -> list[str]:
    """Fill this rank's shards (fp32 masters / frozen shards) through ``read``; returns missing names.

    Every rank must call it (parameters are re-gathered afterwards for stages 1-2).
    """
    engine = engine_of(model)
    names = param_names(model)
    missing: list[str] = []
    for g in engine.groups:
        with g.resident(write_back=True):
            target = g.weight_shard
            for s, lo, hi, where in g.slot_ranges_in_shard():
                values = read(names.get(id(s.param), [s.fqn]), lo, hi)
                if values is None:
                    missing.append(s.fqn)
                    continue
                target[where].copy_(values.reshape(-1))
    missing = sorted(set(missing))
    if missing and strict:
        raise CheckpointError(f"the weights lack {len(missing)} parameter(s) of the model: {missing[:10]}"
                              f"{' ...' if len(missing) > 10 else ''} (strict=False keeps their initial values)")
    _publish(engine)
    return missing


@dataclass
class DeferredWeights:
    """Weights a meta-built model is to get from ``read`` when it is set up (``defer_weights``).

    ``init(model, module)`` initializes the modules first (what no source entry covers keeps
    that value, as ``from_pretrained`` leaves a new head initialized); ``loaded(missing)``
    hears which parameters the source lacked. ``init`` takes the model as an argument so this
    record, held beside the model in a weak table, never keeps it alive.
    """
    read: SliceReader
    source: str
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
    and then reads this rank's slices from the source (``load_sharded_weights``). The
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
    from .._engine.materialize import default_init

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


def load_deferred_weights(model: torch.nn.Module) -> None:
    """Fill a set-up model from the sources ``defer_weights`` recorded on it or its submodules (once)."""
    pending = pending_weights(model)
    if not pending:
        return
    for name, _ in pending:
        _DEFERRED.pop(model.get_submodule(name), None)
    by_prefix = sorted(((f"{name}." if name else "", w) for name, w in pending), key=lambda pw: -len(pw[0]))

    def read(names, start, end):
        for prefix, w in by_prefix:
            own = [n[len(prefix):] for n in names if n.startswith(prefix)]
            if own:
                return w.read(own, start, end)
        return None

    missing = load_sharded_weights(model, read, strict=False)
    for prefix, w in by_prefix:
        if w.loaded is not None:
            w.loaded([m[len(prefix):] for m in missing if m.startswith(prefix)])


def safetensors_reader(directory: str | Path) -> SliceReader:
    """A SliceReader over a Hugging Face model directory (model.safetensors or an index)."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (directory / "model.safetensors").exists():
        with safe_open(directory / "model.safetensors", framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json")
    handles: dict[str, object] = {}

    def read(candidates: list[str], start: int, end: int):
        for name in candidates:
            if name in weight_map:
                file = weight_map[name]
                if file not in handles:
                    handles[file] = safe_open(directory / file, framework="pt")
                sl = handles[file].get_slice(name)
                shape = sl.get_shape()
                return _flat_range(sl, shape, start, end)
        return None

    return read


def _flat_range(sl, shape: list[int], start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of the flattened tensor, reading whole rows of the leading dim only."""
    if not shape:
        return sl[...].reshape(-1)[start:end]
    row = 1
    for d in shape[1:]:
        row *= d
    first, last = start // row, -(-end // row)
    rows = sl[first:last].reshape(-1)
    return rows[start - first * row:end - first * row]


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, state_dict: dict, strict: bool = True) -> list[str]:
    """Load an ordinary (unsharded) state dict into a set-up model, on every rank.

    Each rank copies only its own slices into its shards; buffers are copied whole.
    Tied parameters may appear under any of their names. Returns missing names
    (``strict=False``) and raises on missing ones otherwise.
    """
    def read(names, start, end):
        for name in names:
            if name in state_dict:
                return state_dict[name].reshape(-1)[start:end]
        return None

    missing = load_sharded_weights(model, read, strict=strict)
    for name, buf in model.named_buffers():
        if name in state_dict:
            buf.copy_(state_dict[name])
    return missing
