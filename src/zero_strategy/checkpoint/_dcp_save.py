"""Write a checkpoint of ours, or a set-up model, as a torch.distributed.checkpoint (DCP) directory an
FSDP2 run resumes from: :func:`export_checkpoint` (one process, from a saved checkpoint) and
:func:`save_dcp` (every rank, from the live shards).

[Note: our shards as DCP chunks]
The DCP directory holds what ``dcp.save({"model": ..., "optim": ...})`` of FSDP2's
``get_state_dict`` holds (See [Note: DCP's layout] in _dcp.py), so an FSDP2 run at any world
size resumes it the way the PyTorch tutorials teach::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

DCP reshards on load (each FSDP2 rank reads the chunks overlapping its own Shard(0) rows), so
the chunks need not be FSDP2's: each saved rank of ours holds a flat element range of each
parameter (See [Note: the on-disk layout] in _layout.py), and a flat range is a few boxes
contiguous in row-major order (a partial first row, whole rows, a partial last row, recursively
for more dimensions: :func:`flat_boxes`). Those boxes are the chunks, written by DCP's own
``FileSystemWriter`` through a planner whose items read their elements from our rank files when
the writer asks for them, one at a time: memory stays at one box, whatever the model's size.

Entries: ``model.<key>`` for every key of ``model.state_dict()`` (a tied parameter under each of
its names, buffers included); ``optim.state.<fqn>.<key>`` per trainable parameter (its first
name, as ``get_optimizer_state_dict`` names it): each elementwise state tensor in the
parameter's shape, ``step`` as a 0-d tensor; ``optim.param_groups.<j>.<field>`` with ``params``
listing the group's parameters. Expert parallelism's experts (in :func:`export_checkpoint`) are whole
parameters ``[E, ...]`` like any other, one chunk per expert. The directory is built beside ``out`` and
renamed into place.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from .._engine.engine import refuse_while_offloaded
from .._mechanisms.background_save import join_saves_to
from .._model.gather import whole_model_pass
from ..api import _engine_of
from ._dcp import contiguous_start, flat_boxes
from ._deepspeed_universal import export_universal
from ._layout import BUFFERS_FILE, CheckpointError, Metadata, dtype_from_name, param_names, resolve_zero_optimizers
from ._consolidate import verify_checkpoint_files
from ._experts import expert_group, expert_pieces
from ._load import resolve_checkpoint_dir
from ._metadata_io import read_metadata
from ._owned import OwnedDir, remove_leftovers
from ._sync import agree, describe

EXPORT_FORMATS = ("dcp", "deepspeed-universal")


def export_checkpoint(ckpt_dir: str | os.PathLike, out: str | os.PathLike, format: str = "dcp") -> Path:
    """Write the checkpoint ``ckpt_dir`` (ours, from ``save_checkpoint``) as another system's checkpoint
    at the new directory ``out``; return its path. One process, no ``torch.distributed`` needed.

    ``format="dcp"``: a torch.distributed.checkpoint directory of model and optimizer state that an
    FSDP2 run at any world size resumes (See [Note: our shards as DCP chunks]).
    ``format="deepspeed-universal"``: a DeepSpeed universal checkpoint that DeepSpeed resumes at any
    world size and ZeRO stage with ``"checkpoint": {"load_universal": true}`` (See [Note: the
    universal layout] in _deepspeed_universal.py).
    """
    if format not in EXPORT_FORMATS:
        raise CheckpointError(f"format {format!r}: the formats written are {list(EXPORT_FORMATS)}")
    join_saves_to(str(Path(ckpt_dir).absolute()))  # an asynchronous save of this process to it, first
    ckpt = resolve_checkpoint_dir(ckpt_dir)
    out = Path(out).absolute()
    if out.exists() or out.is_symlink():
        raise CheckpointError(f"output path {out} exists; refusing to overwrite it (choose a new path)")
    meta = read_metadata(ckpt)
    verify_checkpoint_files(ckpt, meta)  # every file, before any output is written
    files = _Files(ckpt, meta)
    items = _model_items(meta, files) + _optimizer_items(meta, files, ckpt) if format == "dcp" else []
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out.parent, (f".{out.name}.tmp-",))  # of a killed run to the same out
    owned = OwnedDir.create(out.parent, f".{out.name}.tmp-")
    try:
        if format == "dcp":
            _write(owned.path, items)
        else:
            export_universal(owned.path, meta, files, ckpt)
        os.rename(owned.path, out)
        owned.moved(out)
        owned.unmark()
    finally:
        owned.remove()  # every failure path, interrupts included; a no-op once renamed into place
        files.close()
    return out


@torch.no_grad()
def save_dcp(path: str | os.PathLike, model: torch.nn.Module, optimizer=None) -> Path:
    """Write a set-up model (and its optimizer's state) as a DCP directory at the new ``path``, every rank
    its own shards (See [Note: our shards as DCP chunks]); the same entries as :func:`export_checkpoint`.

    Every rank must call it; all ranks must see one filesystem at ``path``. Built in a directory beside
    ``path`` that rank 0 renames into place once DCP has written its ``.metadata``: a failed save
    leaves nothing at ``path``. Not written: NVMe-offloaded groups, hybrid sharding, several optimizers
    and the ownership layout (save_checkpoint, then export_checkpoint, covers the first two).
    """
    engine = _engine_of(model)
    refuse_while_offloaded(engine.offloaded, "zero_strategy.checkpoint.save_dcp()",
                           ("optim_states", "hp_params", "lp_params"))
    zopts = resolve_zero_optimizers(engine, optimizer)
    comm = engine.comm
    path = Path(path).absolute()
    decision, owned = None, None
    if comm.rank == 0:
        try:
            _check_live(path, engine, zopts)
            path.parent.mkdir(parents=True, exist_ok=True)
            remove_leftovers(path.parent, (f".{path.name}.tmp-",))
            owned = OwnedDir.create(path.parent, f".{path.name}.tmp-")
            decision = ("ok", str(owned.path))
        except (OSError, CheckpointError) as err:
            decision = ("error", describe(err))
    try:
        kind, value = comm.broadcast_object(decision, src_rank=0)
        if kind == "error":
            raise CheckpointError(value)
        with whole_model_pass(engine):  # See [Note: releases where a phase ends]
            error, items = None, []
            try:
                items = _live_items(model, engine, zopts, comm.rank == 0)
            except Exception as err:  # noqa: BLE001 - agreed on below, raised on every rank
                error = f"cannot save {path} as DCP: {describe(err)}"
            agree(comm, error)
            # DCP's save is collective and raises on every rank when one rank's write fails
            _write(Path(value), items, collective=comm.world_size > 1, process_group=comm.group)
        error = None
        if owned is not None:
            try:
                os.rename(owned.path, path)
                owned.moved(path)
                owned.unmark()
            except OSError as err:
                error = f"cannot move the DCP directory {owned.path} into place at {path}: {err}"
        agree(comm, error)  # every rank returns once the directory is in place
    finally:
        if owned is not None:
            owned.remove()  # every failure path; a no-op once renamed into place
    return path


def _check_live(path: Path, engine, zopts) -> None:
    if path.exists() or path.is_symlink():
        raise CheckpointError(f"{path} exists; save_dcp writes a new directory (choose a new path)")
    if engine.comm.replicas > 1:
        raise CheckpointError("save_dcp does not write hybrid-sharded runs yet: save_checkpoint, then "
                              "export_checkpoint(..., format='dcp')")
    if engine.expert_parallel is not None:  # See [Note: experts in a checkpoint] in _experts.py
        raise CheckpointError(f"expert_parallel_size={engine.expert_parallel.size}: save_dcp does not write the "
                              "rank-local experts; use save_checkpoint, then export_checkpoint(..., format='dcp')")
    if len(zopts) > 1:
        raise CheckpointError(f"{len(zopts)} optimizers: a DCP checkpoint of get_state_dict holds one")
    for g in engine.groups:
        if g.swap is not None:
            raise CheckpointError(f"{g.name} rests on NVMe, which save_dcp does not read yet: save_checkpoint, "
                                  "then export_checkpoint(..., format='dcp')")
        if g.trainable and g.owned and zopts:
            raise CheckpointError(f"{g.name}: its optimizer state is kept whole per parameter (the ownership "
                                  "layout), which is not written to DCP yet")


def _live_items(model, engine, zopts, first: bool) -> list[_Item]:
    """This rank's entries: its element ranges of every weight and elementwise state tensor; on the
    first rank also the scalars, the param groups and the buffers."""
    names = param_names(model)
    items: list[_Item] = []
    members: dict[int, list[str]] = {}
    zopt = zopts[0] if zopts else None
    for g in engine.groups:
        state = zopt.optimizer.state.get(g.master, {}) if zopt is not None and g.trainable else {}
        elementwise = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1
                       and v.numel() == g.shard_numel}
        for s in g.slots:
            fqn = names[id(s.param)][0]
            if zopt is not None and g.trainable:
                members.setdefault(g.optimizer_group, []).append(fqn)
                if first:
                    items += [_value_item(("optim", "state", fqn, k), v) for k, v in state.items()
                              if k not in elementwise]
        for s, lo, hi, where in g.slot_ranges_in_shard():
            all_names, fqn = names[id(s.param)], names[id(s.param)][0]
            sources = [(("model", n), g.weight_shard[where]) for n in all_names]
            sources += [(("optim", "state", fqn, k), v[where]) for k, v in elementwise.items()]
            for nested, flat in sources:
                for offsets, sizes in flat_boxes(s.shape, lo, hi):
                    a = contiguous_start(s.shape, offsets, sizes) - lo
                    n = math.prod(sizes)
                    items.append((".".join(nested), nested, (offsets, sizes, tuple(s.shape), flat.dtype),
                                  lambda t=flat, a=a, n=n, sizes=sizes: t[a:a + n].reshape(sizes)))
    if not first:
        return items
    if zopt is not None:
        for j, pg in enumerate(zopt.optimizer.param_groups):
            items += [_value_item(("optim", "param_groups", j, k), v) for k, v in pg.items() if k != "params"]
            items.append(_value_item(("optim", "param_groups", j, "params"), list(members.get(j, []))))
    managed = engine.managed
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in managed:
            items.append(_value_item(("model", key), t.detach()))
    return items


def _value_item(nested: tuple, value: Any) -> _Item:
    """A whole tensor (one chunk) or a pickled value at ``nested``."""
    key = ".".join(map(str, nested))
    if torch.is_tensor(value):
        shape = tuple(value.shape)
        return key, nested, ((0,) * len(shape), shape, shape, value.dtype), lambda v=value: v.detach().cpu()
    return key, nested, None, lambda v=value: v


class _Files:
    """Our rank files and buffers file, opened once each, read by element range."""

    def __init__(self, ckpt: Path, meta: Metadata):
        self.ckpt, self.meta, self._open = ckpt, meta, {}

    def handle(self, name: str):
        from safetensors import safe_open

        if name not in self._open:
            self._open[name] = safe_open(str(self.ckpt / name), framework="pt")
        return self._open[name]

    def range(self, rank: int, tensor: str, a: int, b: int) -> torch.Tensor:
        return self.handle(self.meta.rank_file(rank)).get_slice(tensor)[a:b]

    def close(self) -> None:
        self._open.clear()


#: (entry, its path in the nested state dict, None for a value or (offsets, sizes, full shape, dtype)
#: for a chunk, the data when asked for)
_Item = tuple[str, tuple, Any, Callable[[], Any]]


def _param_items(path: tuple, meta: Metadata, files: _Files, fqn: str, tensor_of) -> list[_Item]:
    """The chunks of parameter ``fqn`` (its weight, or a state tensor: ``tensor_of(group)``) as entry
    ``path``: one box per contiguous part of each saved rank's element range (See [Note: our shards as
    DCP chunks])."""
    p = meta.params[fqn]
    group = meta.groups[p.group]
    name = tensor_of(group)
    dtype = _stored_dtype(group, name)
    items: list[_Item] = []
    for rank, a, b, at in meta.pieces(fqn, 0, p.numel):
        for offsets, sizes in flat_boxes(p.shape, at, at + b - a):
            n = math.prod(sizes)
            start = a + contiguous_start(p.shape, offsets, sizes) - at
            items.append((".".join(map(str, path)), path, (offsets, sizes, tuple(p.shape), dtype),
                          lambda rank=rank, s=start, n=n, sizes=sizes: files.range(rank, name, s, s + n).reshape(sizes)))
    return items


def _expert_items(path: tuple, meta: Metadata, files: _Files, fqn: str, suffix: str,
                  dtype: torch.dtype) -> list[_Item]:
    """The fused experts parameter ``fqn`` ``[E, ...]`` of an expert-parallel checkpoint (or, with ``suffix``
    ``".state.<key>"``, one of its optimizer-state tensors) as entry ``path``: one chunk per expert, its
    row ``[e:e+1]``, read from the experts file that holds it (See [Note: experts in a checkpoint] in
    _experts.py); memory holds one expert."""
    desc = meta.experts["params"][fqn]
    shape, sizes = (desc["num_experts"], *desc["shape"]), (1, *desc["shape"])
    return [(".".join(map(str, path)), path, ((e,) + (0,) * len(desc["shape"]), sizes, shape, dtype),
             lambda f=f, n=n: files.handle(f).get_tensor(n).reshape(sizes))
            for e, (f, n, _) in enumerate(expert_pieces(meta.experts, fqn, suffix))]


def _expert_state_items(meta: Metadata, files: _Files) -> list[_Item]:
    """``optim.state.<fqn>.<key>`` of expert parallelism's experts: elementwise state per expert, fused again
    (:func:`_expert_items`); scalars as a flat group's."""
    items: list[_Item] = []
    for fqn, entry in meta.experts["state"].items():
        for key, dt in entry["tensors"].items():
            items += _expert_items(("optim", "state", fqn, key), meta, files, fqn, f".state.{key}",
                                   dtype_from_name(dt))
        items += _scalar_items(fqn, entry["scalars"])
    return items


def _scalar_items(fqn: str, scalars: dict) -> list[_Item]:
    items: list[_Item] = []
    for key, sc in scalars.items():
        if sc["tensor"]:
            value = torch.tensor(sc["value"], dtype=dtype_from_name(sc["dtype"])).reshape(sc["shape"])
            zeros = (0,) * value.dim()
            items.append((f"optim.state.{fqn}.{key}", ("optim", "state", fqn, key),
                          (zeros, tuple(value.shape), tuple(value.shape), value.dtype), lambda v=value: v))
        else:
            items.append((f"optim.state.{fqn}.{key}", ("optim", "state", fqn, key), None, lambda v=sc["value"]: v))
    return items


def _stored_dtype(group, tensor_name: str) -> torch.dtype:
    if tensor_name == group.weight_tensor:
        return dtype_from_name(group.dtype)
    key = next(k for k in group.state_tensors if group.state_tensor(k) == tensor_name)
    return dtype_from_name(group.state_tensors[key])


def _model_items(meta: Metadata, files: _Files) -> list[_Item]:
    items: list[_Item] = []
    for key, kind, name in meta.state_dict_keys:
        if kind == "param":
            items += _param_items(("model", key), meta, files, name, lambda g: g.weight_tensor)
        elif kind == "expert":
            desc = meta.experts["params"][name]
            items += _expert_items(("model", key), meta, files, name, "", dtype_from_name(desc["dtype"]))
        else:
            t = files.handle(BUFFERS_FILE).get_tensor(name)
            zeros = (0,) * t.dim()
            items.append((f"model.{key}", ("model", key), (zeros, tuple(t.shape), tuple(t.shape), t.dtype),
                          lambda t=t: t))
    return items


def _optimizer_items(meta: Metadata, files: _Files, ckpt: Path) -> list[_Item]:
    optimizers = meta.optimizers if meta.optimizers is not None else ([meta.optimizer] if meta.optimizer else [])
    if not optimizers:
        return []
    if len(optimizers) > 1:
        raise CheckpointError(f"{ckpt} holds the state of {len(optimizers)} optimizers; a DCP checkpoint of "
                              "get_state_dict holds one: export the weights alone with consolidate")
    items: list[_Item] = []
    members: dict[int, list[str]] = {}
    for fqn, p in meta.params.items():
        group = meta.groups[p.group]
        if not group.trainable:
            continue
        if group.owned or group.param_state:
            raise CheckpointError(f"{ckpt}: {fqn}'s optimizer state is kept whole per parameter (the ownership "
                                  "layout), which is not exported to DCP yet: export the weights with consolidate")
        members.setdefault(group.optimizer_group, []).append(fqn)
        for key in group.state_tensors:
            items += _param_items(("optim", "state", fqn, key), meta, files, fqn,
                                  lambda g, key=key: g.state_tensor(key))
        items += _scalar_items(fqn, group.state_scalars)
    if meta.experts is not None:  # See [Note: experts in a checkpoint] in _experts.py
        j = expert_group(meta, optimizers[0], ckpt, "a DCP checkpoint")
        members.setdefault(j, []).extend(meta.experts["params"])
        items += _expert_state_items(meta, files)
    for j, fields in enumerate(optimizers[0]["param_groups"]):
        for field, value in fields.items():
            if field != "params":
                items.append((f"optim.param_groups.{j}.{field}", ("optim", "param_groups", j, field), None,
                              lambda v=value: tuple(v) if isinstance(v, list) else v))
        items.append((f"optim.param_groups.{j}.params", ("optim", "param_groups", j, "params"), None,
                      lambda names=members.get(j, []): list(names)))
    return items


def _write(out: Path, items: list[_Item], collective: bool = False, process_group=None) -> None:
    """``items`` through DCP's ``FileSystemWriter``, each resolved when the writer asks for it.
    ``collective``: every rank of ``process_group`` (None: the default group) writes its own items."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    write_items, data, paths = [], {}, {}
    for key, nested, chunk, get in items:
        paths[key] = nested
        if chunk is None:
            index = MetadataIndex(key)
            write_items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
        else:
            offsets, sizes, shape, dtype = chunk
            index = MetadataIndex(key, torch.Size(offsets))
            write_items.append(WriteItem(
                index=index, type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                                            properties=TensorProperties(dtype=dtype), size=torch.Size(shape))))
        data[(key, None if chunk is None else tuple(chunk[0]))] = get

    class Planner(DefaultSavePlanner):
        """Plans exactly ``write_items``; their data comes from our files when written. The entries'
        paths are recorded as DCP's flattening records them, so ``dcp_to_torch_save`` and
        ``_load_state_dict_from_keys`` rebuild the nested dicts."""

        def __init__(self):
            super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            self.mappings = paths

        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(write_items, planner_data=paths)
            return self.plan

        def resolve_data(self, write_item):
            index = write_item.index
            value = data[(index.fqn, None if index.offset is None else tuple(index.offset))]()
            if write_item.type == WriteItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(value, buf)
                buf.seek(0)
                return buf
            return value

    writer = dcp.FileSystemWriter(str(out), single_file_per_rank=True, thread_count=1)
    if collective:
        dcp.save({}, storage_writer=writer, planner=Planner(), process_group=process_group)
        return
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save({}, storage_writer=writer, planner=Planner(), no_dist=True)
