"""Load full-model weights into a set-up model, each rank reading only its own slices.

A pretrained model directory (Hugging Face safetensors, one file or sharded with an
index) holds every parameter whole. Under ZeRO each rank owns a contiguous slice of
each flat group; ``load_sharded_weights`` asks a reader for exactly the elements of
that slice, parameter by parameter, so no rank ever materializes the full model,
and then rebuilds the compute-dtype parameters as after an optimizer step.
"""

from __future__ import annotations

import json
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


def safetensors_weight_map(directory: str | Path) -> dict[str, str]:
    """Tensor name -> file of a Hugging Face model directory (model.safetensors or an index)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    if (directory / "model.safetensors").exists():
        from safetensors import safe_open

        with safe_open(directory / "model.safetensors", framework="pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    if any(directory.glob("pytorch_model*.bin")):
        raise CheckpointError(f"{directory} holds only pytorch_model*.bin weights, which cannot be read in "
                              "slices; convert them once with model.save_pretrained(dir) (safetensors), or load "
                              "with transformers' from_pretrained and then zero_strategy.setup")
    raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json")


def safetensors_reader(directory: str | Path) -> SliceReader:
    """A SliceReader over a Hugging Face model directory (model.safetensors or an index)."""
    from safetensors import safe_open

    directory = Path(directory)
    weight_map = safetensors_weight_map(directory)
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
