"""Load full-model weights into a set-up model, each rank reading only its own slices.

A pretrained model directory (Hugging Face safetensors, one file or sharded with an
index) holds every parameter whole. Under ZeRO each rank owns a contiguous slice of
each flat group; ``load_sharded_weights`` asks a reader for exactly the elements of
that slice, parameter by parameter, so no rank ever materializes the full model,
and then rebuilds the compute-dtype parameters as after an optimizer step.

[Note: shapes before values]
Reading a slice of a flattened tensor works whatever the tensor's shape: a ``[4, 6]``
tensor filled a ``[6, 4]`` weight, a 3-label head the first rows of a 2-label one, and
a tensor too small failed on the ranks whose slice fell past its end, with a message
naming no parameter. So before any value is copied, every parameter's source is
compared with the model, as ``torch``'s ``load_state_dict`` and ``transformers``' loaders
do: its shape (a 1-element tensor may fill a 0-d parameter, as in torch) and, for a
floating-point parameter, that the source holds floating-point values (torch would cast
integers silently). Each rank checks every parameter, not just its slices, and the ranks
agree on the outcome, so each raises the same error naming each parameter and both
shapes, and a refused load has copied nothing. A reader tells shapes through its
``shape_of(names)``; a plain function reader has none, and is checked as it is read
(each piece must hold the elements asked for), after the slices before it were copied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping

import torch

from ..api import _engine_of
from ._layout import CheckpointError, param_names
from ._load import _publish
from ._sync import agree, describe

#: read(names, start, end) -> 1-D tensor of the flattened parameter's elements [start, end)
#: for the first of ``names`` the source has, or None if it has none of them. A reader may also
#: have ``shape_of(names) -> (shape, dtype) | None`` of that same tensor (See [Note: shapes
#: before values]).
SliceReader = Callable[[list[str], int, int], "torch.Tensor | None"]


@torch.no_grad()
def load_sharded_weights(model: torch.nn.Module, read: SliceReader, strict: bool = True) -> list[str]:
    """Fill this rank's shards (fp32 masters / frozen shards) through ``read``; returns missing names.

    Every rank must call it (parameters are re-gathered afterwards for stages 1-2). Shapes
    are compared before anything is copied (See [Note: shapes before values]).
    """
    return _load(model, read, strict, buffers={})


def _load(model: torch.nn.Module, read: SliceReader, strict: bool, buffers: Mapping[str, torch.Tensor]) -> list[str]:
    """``load_sharded_weights`` and the buffers of a full state dict: check, agree, copy, agree, publish."""
    engine = _engine_of(model)
    names = param_names(model)
    error, missing = None, None
    try:
        missing = _check(engine, names, read, strict, model, buffers)
    except Exception as err:  # noqa: BLE001 - agreed on below, raised on every rank
        error = describe(err)
    agree(engine.comm, error)
    error, found = None, []
    try:
        found = _copy(engine, names, read, skip=set(missing or ()))
        for name, buf in model.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name])
        if missing is None:  # a plain function reader: what it lacked is known only now
            missing = sorted(set(found))
            _refuse_missing(missing, strict)
    except Exception as err:  # noqa: BLE001 - agreed on below, raised on every rank
        error = describe(err)
    agree(engine.comm, error)
    _publish(engine)
    return missing


def _check(engine, names, read, strict: bool, model, buffers: Mapping[str, torch.Tensor]) -> list[str] | None:
    """Compare every source tensor with its parameter (and buffer); the missing names (None: the
    reader cannot tell before reading). See [Note: shapes before values]."""
    errors = []
    for name, buf in model.named_buffers():
        value = buffers.get(name)
        if name in buffers and not isinstance(value, torch.Tensor):
            errors.append(f"{name}: the state dict holds a {type(value).__name__}, not a tensor")
        elif name in buffers and tuple(value.shape) != tuple(buf.shape):
            errors.append(_mismatch(name, tuple(value.shape), tuple(buf.shape)))
    shape_of = getattr(read, "shape_of", None)
    missing: list[str] | None = None if shape_of is None else []
    slots = [] if shape_of is None else [s for g in engine.groups for s in g.slots]  # every rank: all of them
    for s in slots:
        found = shape_of(names.get(id(s.param), [s.fqn]))
        if found is None:
            missing.append(s.fqn)
            continue
        shape, dtype = tuple(found[0]), found[1]
        if shape != tuple(s.shape) and not (len(s.shape) == 0 and shape == (1,)):
            errors.append(_mismatch(s.fqn, shape, tuple(s.shape)))
        elif s.param.dtype.is_floating_point and not dtype.is_floating_point:
            errors.append(f"dtype mismatch for {s.fqn}: copying a param of dtype {dtype} from checkpoint "
                          f"into a {s.param.dtype} parameter")
    if errors:
        raise CheckpointError(f"Error(s) in loading weights into {type(model).__name__}:\n\t" + "\n\t".join(errors))
    if missing is not None:
        missing = sorted(set(missing))
        _refuse_missing(missing, strict)
    return missing


def _mismatch(name: str, saved: tuple, here: tuple) -> str:
    """torch's own words (``load_state_dict``), which transformers repeats."""
    return (f"size mismatch for {name}: copying a param with shape {torch.Size(saved)} from checkpoint, "
            f"the shape in current model is {torch.Size(here)}.")


def _refuse_missing(missing: list[str], strict: bool) -> None:
    if missing and strict:
        raise CheckpointError(f"the weights lack {len(missing)} parameter(s) of the model: {missing[:10]}"
                              f"{' ...' if len(missing) > 10 else ''} (strict=False keeps their initial values)")


def _copy(engine, names, read, skip: set[str]) -> list[str]:
    """This rank's slices into its shards; the parameters ``read`` had none of (plain readers)."""
    lacking: list[str] = []
    for g in engine.groups:
        with g.resident(write_back=True):
            target = g.weight_shard
            for s, lo, hi, where in g.slot_ranges_in_shard():
                if s.fqn in skip:
                    continue
                values = read(names.get(id(s.param), [s.fqn]), lo, hi)
                if values is None:
                    lacking.append(s.fqn)
                    continue
                if values.numel() != hi - lo:
                    raise CheckpointError(f"size mismatch for {s.fqn}: the weights give {values.numel()} elements "
                                          f"where its elements [{lo}, {hi}) are asked for: the tensor is smaller "
                                          f"than the parameter's shape {torch.Size(s.shape)}")
                target[where].copy_(values.reshape(-1))
    return lacking


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
    return _SafetensorsReader(Path(directory))


class _SafetensorsReader:
    """Slices of the tensors of a model directory's safetensors files, opened on first use; their
    shapes and dtypes from the headers (See [Note: shapes before values])."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.weight_map = safetensors_weight_map(directory)
        self._handles: dict[str, object] = {}

    def _slice(self, candidates: list[str]):
        for name in candidates:
            if name in self.weight_map:
                file = self.weight_map[name]
                if file not in self._handles:
                    from safetensors import safe_open

                    try:
                        self._handles[file] = safe_open(self.directory / file, framework="pt")
                    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                        raise CheckpointError(f"{self.directory / file} is not a readable safetensors file: "
                                              f"{err}") from None
                try:
                    return self._handles[file].get_slice(name)
                except Exception as err:  # noqa: BLE001 - an index naming a tensor its file lacks
                    raise CheckpointError(f"{self.directory / file} has no tensor {name!r}, which "
                                          f"model.safetensors.index.json places there ({err})") from None
        return None

    def slice_of(self, name: str):
        """The safetensors slice of tensor ``name`` (``get_shape()``, ``get_dtype()``, ``[rows]``), or None."""
        return self._slice([name])

    def shape_of(self, candidates: list[str]) -> tuple[list[int], torch.dtype] | None:
        sl = self._slice(candidates)
        if sl is None:
            return None
        return list(sl.get_shape()), dtype_of_safetensors(sl.get_dtype())

    def __call__(self, candidates: list[str], start: int, end: int):
        sl = self._slice(candidates)
        return None if sl is None else _flat_range(sl, sl.get_shape(), start, end)


#: safetensors dtype names -> torch dtypes (an unknown one reads as non-floating, and a
#: floating-point parameter refuses it)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def dtype_of_safetensors(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (an unknown one: uint8, non-floating)."""
    return _DTYPES.get(name, torch.uint8)


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


class _StateDictReader:
    """Slices of the tensors of an ordinary state dict (every rank holds it whole)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor]):
        self.state_dict = state_dict

    def _tensor(self, names: list[str]) -> torch.Tensor | None:
        for name in names:
            if name in self.state_dict:
                value = self.state_dict[name]
                if not isinstance(value, torch.Tensor):
                    raise CheckpointError(f"state_dict[{name!r}] is a {type(value).__name__}, not a tensor")
                return value
        return None

    def shape_of(self, names: list[str]) -> tuple[torch.Size, torch.dtype] | None:
        t = self._tensor(names)
        return None if t is None else (t.shape, t.dtype)

    def __call__(self, names: list[str], start: int, end: int) -> torch.Tensor | None:
        t = self._tensor(names)
        return None if t is None else t.reshape(-1)[start:end]


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, state_dict: dict, strict: bool = True) -> list[str]:
    """Load an ordinary (unsharded) state dict into a set-up model, on every rank.

    Each rank copies only its own slices into its shards; buffers are copied whole.
    Tied parameters may appear under any of their names. Returns missing names
    (``strict=False``) and raises on missing ones otherwise. Every tensor's shape is
    compared with the model's before anything is copied (See [Note: shapes before values]).
    """
    buffers = {name: state_dict[name] for name, _ in model.named_buffers() if name in state_dict}
    return _load(model, _StateDictReader(state_dict), strict, buffers)
