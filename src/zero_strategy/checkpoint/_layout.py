"""What a checkpoint holds and where each element sits: the metadata, by fully qualified name.

[Note: the on-disk layout]
A checkpoint is a directory::

    metadata.json                       written last: its presence marks a complete checkpoint
    rank00000-of-00002.safetensors      rank 0's shards (one file per rank)
    rank00001-of-00002.safetensors
    buffers.safetensors                 module buffers (rank 0)
    extra_state.pt                      user state that is not JSON (rank 0; optional)
    experts00000-of-00002.safetensors   expert parallelism's experts, one tensor per expert
                                        (See [Note: experts in a checkpoint] in _experts.py)

A rank file holds, for flat group ``i`` of the saving run, 1-D tensors of
``shard_numel`` elements: ``g{i}.master`` (fp32 master shard, trainable groups) or
``g{i}.frozen`` (the parameter shard in the compute dtype, frozen groups), and
``g{i}.state.<key>`` for every elementwise optimizer-state tensor (Adam's
``exp_avg``...). Scalar optimizer state (Adam's ``step``) is the same on every rank
and lives in the metadata.

A group in the ownership layout (Muon, Adafactor: See [Note: the ownership layout] in
_engine/flat.py) has per-parameter optimizer state instead, of any shape (Adafactor's row
and column factors): the owner's rank file holds ``g{i}.p{j}.<key>`` (flattened) for slot
``j`` of the group, and the group's ``param_state`` records, by fully qualified name, the
owning rank, the slot, each tensor's dtype and shape and the non-tensor values. A reader
at any world size takes a parameter's whole state from that one file, whichever rank owns
the parameter now.

Each parameter is recorded by its fully qualified name with its group and offset
in that group's flat buffer; with the group's ``shard_numel`` this says which rank
file holds any element: flat element ``e`` of group ``g`` is element
``e % shard_numel`` of rank ``e // shard_numel``'s ``g{g}.*`` tensors. This is all
a reader needs to re-shard onto any world size, stage or grouping, one parameter
slice at a time. Nothing here depends on where the engine keeps its tensors
(device, CPU offload, NVMe): savers read shards through host copies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._optim.optimizer import ZeroOptimizer

FORMAT_NAME = "zero_strategy.checkpoint"
FORMAT_VERSION = 2
#: versions this zero_strategy reads: 1 recorded each file's bare sha256 hex (``sha256``), 2 its
#: ``digest`` as ``<algorithm>:<hex>`` (See [Note: file digests] in _mechanisms/safetensors_writer.py)
READABLE_VERSIONS = (1, 2)
METADATA_FILE = "metadata.json"
BUFFERS_FILE = "buffers.safetensors"
EXTRA_STATE_FILE = "extra_state.pt"


class CheckpointError(ValueError):
    """A checkpoint cannot be written, read or consolidated; the message names the cause."""


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank{rank:05d}-of-{world_size:05d}.safetensors"


_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CheckpointError(f"unsupported dtype {name!r} in checkpoint metadata") from None


@dataclass
class GroupLayout:
    """One flat group of the saving run."""

    index: int
    name: str
    trainable: bool
    optimizer_group: int | None
    shard_params: bool
    dtype: str                 # dtype of the stored weight shard (float32 for masters)
    numel: int                 # real elements
    padded_numel: int
    shard_numel: int
    world_size: int
    #: elementwise optimizer-state tensors: key -> dtype name (stored as g{i}.state.<key>)
    state_tensors: dict[str, str] = field(default_factory=dict)
    #: scalar optimizer state: key -> {"value", "tensor", "dtype", "on_param_device"}
    state_scalars: dict[str, dict] = field(default_factory=dict)
    #: which of the saving run's optimizers stepped this group (several: e.g. a GAN)
    optimizer_index: int | None = None
    #: the ownership layout: optimizer state per parameter (``param_state``), not per shard
    owned: bool = False
    #: fqn -> {"rank", "slot", "tensors": {key: {"dtype", "shape", "on_param_device"}},
    #: "scalars": {key: {"value", "tensor": false}}}, for owned groups (stored as g{i}.p{slot}.<key>)
    param_state: dict[str, dict] = field(default_factory=dict)

    @property
    def weight_tensor(self) -> str:
        return f"g{self.index}.{'master' if self.trainable else 'frozen'}"

    def state_tensor(self, key: str) -> str:
        return f"g{self.index}.state.{key}"

    def param_state_tensor(self, slot: int, key: str) -> str:
        return f"g{self.index}.p{slot}.{key}"


@dataclass
class ParamLayout:
    """Where one parameter's elements sit: ``numel`` elements from ``offset`` of group ``group``."""

    fqn: str
    names: list[str]           # every name it is registered under (tied parameters: several)
    shape: list[int]
    group: int
    offset: int
    numel: int


@dataclass
class FileRecord:
    name: str
    digest: str                # "<algorithm>:<hex>" (a version-1 file's sha256 reads as "sha256:<hex>")
    bytes: int
    rank: int | None = None


@dataclass
class Metadata:
    world_size: int
    stage: int
    precision: str
    groups: list[GroupLayout]
    params: dict[str, ParamLayout]
    #: model.state_dict() keys in order: [key, "param", fqn], [key, "buffer", key] or [key, "expert", fqn]
    state_dict_keys: list[list[str]]
    files: list[FileRecord]
    optimizer: dict | None = None      # {"class", "module", "param_groups"} of the first optimizer
    loss_scaler: dict | None = None
    #: every optimizer given to setup(), in order (``optimizer`` is the first of them)
    optimizers: list | None = None
    loss_scalers: list | None = None
    extra_state: dict | None = None    # {"kind": "json", "value": ...} | {"kind": "torch", "file": ...}
    #: expert parallelism's rank-local experts: {"size", "params", "state"}; See [Note: experts in a
    #: checkpoint] in _experts.py (None: saved without expert parallelism)
    experts: dict | None = None
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION
    zero_strategy_version: str = ""
    #: sha256 of the canonical JSON of every other key. See [Note: the metadata is input, not truth]
    checksum: str = ""

    # ----------------------------------------------------------------- queries
    def file(self, name: str) -> FileRecord:
        for f in self.files:
            if f.name == name:
                return f
        raise CheckpointError(f"checkpoint metadata lists no file {name!r}")

    def rank_file(self, rank: int) -> str:
        return rank_file_name(rank, self.world_size)

    def alias_map(self) -> dict[str, str]:
        """Every registered parameter name -> the fqn its layout is recorded under."""
        return {name: fqn for fqn, p in self.params.items() for name in p.names}

    def buffer_keys(self) -> list[str]:
        return [k for k, kind, _ in self.state_dict_keys if kind == "buffer"]

    def pieces(self, fqn: str, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """Elements [lo, hi) of parameter ``fqn`` as (rank, start, stop, dst): rank file ``rank``
        holds them at [start, stop) of its group tensors; they go to [dst, dst + stop - start)."""
        p = self.params[fqn]
        s = self.groups[p.group].shard_numel
        first, last = p.offset + lo, p.offset + hi
        out = []
        for k in range(first // s, (last - 1) // s + 1):
            a, b = max(first, k * s), min(last, (k + 1) * s)
            out.append((k, a - k * s, b - k * s, a - first))
        return out


def is_checkpoint_dir(path: Path) -> bool:
    try:
        d = json.loads((path / METADATA_FILE).read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(d, dict) and d.get("format") == FORMAT_NAME


# ------------------------------------------------------- engine -> layout
def param_names(model: torch.nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every name it is registered under, in registration order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def describe_groups(engine) -> list[GroupLayout]:
    """The saving run's flat groups (without optimizer state), from the engine's public attributes."""
    out = []
    for i, g in enumerate(engine.groups):
        stored = g.weight_shard.dtype
        out.append(GroupLayout(
            index=i, name=g.name, trainable=bool(g.trainable), optimizer_group=g.optimizer_group,
            optimizer_index=g.optimizer_index,
            shard_params=bool(g.shard_params), dtype=dtype_name(stored), numel=int(g.numel),
            padded_numel=int(g.padded_numel), shard_numel=int(g.shard_numel),
            world_size=int(engine.comm.world_size), owned=bool(g.owned)))
    return out


def describe_params(engine, model: torch.nn.Module) -> dict[str, ParamLayout]:
    names = param_names(model)
    out: dict[str, ParamLayout] = {}
    for i, g in enumerate(engine.groups):
        for s in g.slots:
            out[s.fqn] = ParamLayout(fqn=s.fqn, names=names.get(id(s.param), [s.fqn]), shape=list(s.shape),
                                     group=i, offset=int(s.offset), numel=int(s.numel))
    return out


def resolve_zero_optimizers(engine, optimizer) -> list:
    """The engine's ZeroOptimizers, in setup() order, from what the caller passed.

    Accepts None (weights only: ``[]``), the ZeroOptimizer(s) ``setup`` returned, or the
    user's optimizer(s) they re-homed. A model set up with several optimizers needs all
    of them (their states share the rank files).
    """
    if optimizer is None:
        return []
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    mine = engine.optimizers()
    out = []
    for opt in given:
        if isinstance(opt, ZeroOptimizer):
            if opt.engine is not engine:
                raise CheckpointError("the optimizer was set up with a different model than the one given")
            out.append(opt)
            continue
        match = next((z for z in mine if z.optimizer is opt), None)
        if match is None:
            raise CheckpointError("optimizer: pass the optimizer returned by zero_strategy.setup(model, "
                                  "optimizer) for this model")
        out.append(match)
    if len(out) != len(mine):
        raise CheckpointError(f"the model was set up with {len(mine)} optimizers; pass all of them "
                              f"(a list, in setup order), not {len(out)}")
    return sorted(out, key=lambda z: z.index)


def jsonable(value: Any) -> Any:
    """Hyperparameter values as JSON (tensors as numbers, tuples as lists); ``_SKIP`` if impossible."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else _SKIP
    if isinstance(value, (list, tuple)):
        items = [jsonable(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return _SKIP


class _Skip:
    def __repr__(self) -> str:
        return "<not JSON>"


_SKIP = _Skip()
SKIP = _SKIP
