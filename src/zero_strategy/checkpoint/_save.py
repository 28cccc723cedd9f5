"""Sharded, atomic save: every rank writes its own shards; rank 0 writes metadata and swaps.

[Note: atomic replacement]
1. rank 0 checks the target, creates ``.zero_strategy-save-<token>`` beside it (a random
   token of this save, see [Note: what a save may delete] in _owned.py) and broadcasts
   the token;
   every rank writes its file there, hashing it on the way, and fsyncs it;
2. ranks all-gather (file, sha256, size) or their error: any error aborts on all
   ranks and removes the temporary directory;
3. rank 0 writes ``metadata.json`` last and fsyncs the directory, then renames an
   existing ``path`` to ``<path>.old-<token>``, the temporary directory to ``path``,
   fsyncs the parent and deletes the old one; the result is agreed on, so no rank
   returns before the checkpoint is in place.
A save killed before step 3's first rename leaves ``path`` untouched (and a
``.zero_strategy-save-`` directory without metadata, removed by the next save there). Killed between the
two renames, ``path`` is missing and the previous checkpoint sits complete at
``<path>.old-<token>``: ``load_checkpoint(path)`` finds and loads it (with a warning).
Any error in step 3 (a full disk while writing the metadata) puts the previous
checkpoint back and removes the temporary directory, so a retry starts clean.
All ranks must see the same filesystem (as with any multi-node checkpoint).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .._engine.engine import refuse_while_offloaded
from .._mechanisms import nvme_stream
from .._model.gather import whole_model_pass
from .._version import __version__
from ..api import engine_of
from ._layout import (BUFFERS_FILE, EXTRA_STATE_FILE, METADATA_FILE, SKIP, CheckpointError, FileRecord, GroupLayout,
                      Metadata, describe_groups, describe_params, dtype_name, is_checkpoint_dir, jsonable,
                      rank_file_name, resolve_zero_optimizers)
from ._metadata_io import metadata_json
from ._owned import SAVE_PREFIX, OwnedDir, leftover_prefixes, remove_leftovers, save_dir
from ._safetensors_stream import StreamWriter, sha256_file
from ._sync import agree, describe

_rename = os.rename  # module-level so tests can interrupt a save between the renames


@torch.no_grad()
def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer=None,
                    extra_state: Any = None) -> None:
    """Save ``model`` (and ``optimizer``'s state) as a sharded checkpoint directory at ``path``.

    Every rank must call it. ``optimizer``: the one ``setup`` returned (or None for
    weights only). ``extra_state``: anything of yours to resume with (step counter,
    scheduler or data-loader state); JSON-able values go into the metadata, others
    into ``extra_state.pt`` (torch.save). An existing checkpoint at ``path`` is
    replaced atomically; any other existing file or directory there is refused.
    """
    engine = engine_of(model)
    refuse_while_offloaded(engine.offloaded, "zero_strategy.save_checkpoint()", ("optim_states", "hp_params", "lp_params"))
    with whole_model_pass(engine):  # See [Note: releases where a phase ends]
        _save_across_groups(path, model, engine, optimizer, extra_state)


def _save_across_groups(path, model, engine, optimizer, extra_state) -> None:
    comm = engine.comm
    if comm.replicas == 1:
        _save_in_group(path, model, engine, optimizer, extra_state)
        return
    # [Note: hybrid checkpoints] every shard group holds the same shards: the first one writes
    # the checkpoint (a flat one of its k ranks, loadable at any world size, hybrid or not),
    # and tells its replicas in the other groups how it went, so every rank returns or raises.
    outcome = None
    if comm.replica_index == 0:
        try:
            _save_in_group(path, model, engine, optimizer, extra_state)
        except CheckpointError as err:
            outcome = str(err)
    outcome = comm.broadcast_object_across_groups(outcome, label="checkpoint outcome")
    if outcome is not None:
        raise CheckpointError(outcome)


def _save_in_group(path, model, engine, optimizer, extra_state) -> None:
    comm = engine.comm
    zopts = resolve_zero_optimizers(engine, optimizer)
    path = Path(path).absolute()
    decision: tuple[str, str] | None = None
    owned: OwnedDir | None = None
    if comm.rank == 0:
        try:
            _check_target(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            owned = OwnedDir.create(path.parent, SAVE_PREFIX)
            decision = ("ok", owned.token)
        except (OSError, CheckpointError) as err:
            decision = ("error", describe(err))
    try:
        _save(path, model, engine, zopts, extra_state, decision, owned)
    finally:
        if owned is not None:
            owned.remove()  # a no-op once the directory became the checkpoint; else every failure path


def _save(path: Path, model, engine, zopts, extra_state, decision, owned: OwnedDir | None) -> None:
    """[Note: one filesystem for all ranks]
    Each rank writes its own shard file into the directory rank 0 creates, and rank 0
    publishes the directory once every file is there, so all ranks must see one
    filesystem at ``path`` (multi-node: a shared mount). A rank that does not see rank
    0's new directory says so, the ranks agree on the error, and nothing is published,
    instead of each node keeping a part of the checkpoint that no node can load.
    """
    comm = engine.comm
    kind, value = comm.broadcast_object(decision, src_rank=0)
    if kind == "error":
        raise CheckpointError(value)
    token = value
    tmp = save_dir(path.parent, token)

    groups = describe_groups(engine)
    records: list[FileRecord] = []
    error = extra_meta = None
    try:
        if not tmp.is_dir():  # See [Note: one filesystem for all ranks]
            raise CheckpointError(
                f"this rank cannot see {tmp}, the directory rank 0 created for the checkpoint just now: "
                "save_checkpoint needs one filesystem shared by every rank (NFS, Lustre, a mounted bucket) "
                "and the same path on each; on nodes without one, give every rank a path on a shared mount")
        records.append(_write_rank_file(tmp, engine, zopts, groups))
        if comm.rank == 0:
            records.append(_write_buffers(tmp, model, engine))
            extra_meta, extra_record = _write_extra_state(tmp, extra_state)
            if extra_record is not None:
                records.append(extra_record)
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        error = f"rank {comm.rank} could not write its checkpoint file in {tmp}: {describe(err)}"
    owned_state = {layout.index: layout.param_state for layout in groups if layout.owned}
    gathered = comm.all_gather_object((records, error, owned_state))
    errors = [e for _, e, _ in gathered if e]
    if errors:
        raise CheckpointError("; ".join(errors))  # rank 0 removes the directory on the way out

    error = None
    if comm.rank == 0:
        try:
            for _, _, states in gathered:  # each owner recorded its own parameters' state
                for index, entries in states.items():
                    groups[index].param_state.update(entries)
            files = [r for recs, _, _ in gathered for r in recs]
            meta = _metadata(model, engine, zopts, groups, files, extra_meta)
            _write_metadata(tmp, meta)
            _swap_into_place(owned, path)
        except Exception as err:  # noqa: BLE001
            error = f"rank 0 could not finish the checkpoint at {path}: {describe(err)}"
    agree(comm, error if comm.rank == 0 else None)


# ------------------------------------------------------------------ targets
def _check_target(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise CheckpointError(f"{path} exists and is not a checkpoint directory; refusing to replace it "
                              "(choose another path or remove it)")
    if path.is_dir() and not is_checkpoint_dir(path):
        raise CheckpointError(f"{path} exists and is not a zero_strategy checkpoint (no valid "
                              f"{METADATA_FILE}); refusing to replace it (choose another path or remove it)")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(owned: OwnedDir, path: Path) -> None:
    """Rename the finished temporary directory to ``path``; see [Note: atomic replacement].

    On an error before the checkpoint is in place, the previous one is moved back.
    """
    tmp = owned.path
    _fsync_dir(tmp)
    old = None
    if path.exists():
        old = OwnedDir.claim(path, owned.token)
        _rename(path, path.parent / f"{path.name}.old-{owned.token}")
        old.moved(path.parent / f"{path.name}.old-{owned.token}")
    try:
        _rename(tmp, path)
    except BaseException:
        if old is not None and not path.exists():
            _rename(old.path, path)
            old.moved(path)
            old.unmark()
        raise
    owned.moved(path)
    owned.unmark()
    _fsync_dir(path.parent)
    if old is not None:
        old.remove()
    remove_leftovers(path.parent, leftover_prefixes(path.name))  # of killed saves; see _owned.py


# ------------------------------------------------------------------ files
def _optimizer_state(zopts, g, layout: GroupLayout, swapped: frozenset = frozenset()) -> list[tuple[str, torch.Tensor]]:
    """Split one master's optimizer state: elementwise tensors (returned) and scalars (into layout).
    ``swapped``: keys known elementwise while evicted to the NVMe swap file (their tensors empty)."""
    if not zopts or not g.trainable:
        return []
    zopt = zopts[g.optimizer_index]
    tensors = []
    for key, v in sorted(zopt.optimizer.state.get(g.master, {}).items()):
        if key in swapped or (isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == g.shard_numel):
            layout.state_tensors[key] = dtype_name(v.dtype)
            tensors.append((key, v))
        elif isinstance(v, torch.Tensor) and v.numel() == 1:
            layout.state_scalars[key] = {"value": v.item(), "tensor": True, "dtype": dtype_name(v.dtype),
                                         "shape": list(v.shape), "on_param_device": v.device == g.master.device}
        elif v is None or isinstance(v, (bool, int, float)):
            layout.state_scalars[key] = {"value": v, "tensor": False}
        else:
            raise CheckpointError(
                f"optimizer state {key!r} of group {g.name} is neither elementwise (a tensor of the master "
                f"shard's {g.shard_numel} elements) nor a scalar: {type(v).__name__}"
                f"{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}; cannot shard it")
    return tensors


def _param_state(zopts, g, layout: GroupLayout, rank: int) -> list[tuple[str, torch.Tensor]]:
    """The ownership layout: the state of each parameter this rank owns, whole (tensors returned,
    flattened; their shapes and the other values into ``layout.param_state``)."""
    if not zopts or not g.trainable:
        return []
    zopt = zopts[g.optimizer_index]
    tensors = []
    for s, _, view in zopt.owned_views(g):
        state = zopt.optimizer.state.get(view)
        if not state:
            continue  # not stepped yet: nothing to save, as for a flat group
        entry = {"rank": rank, "slot": s.index, "tensors": {}, "scalars": {}}
        for key, v in sorted(state.items()):
            if isinstance(v, torch.Tensor):
                entry["tensors"][key] = {"dtype": dtype_name(v.dtype), "shape": list(v.shape),
                                         "on_param_device": v.device == view.device}
                tensors.append((layout.param_state_tensor(s.index, key), v.detach().contiguous().reshape(-1)))
            elif v is None or isinstance(v, (bool, int, float)):
                entry["scalars"][key] = {"value": v, "tensor": False}
            else:
                raise CheckpointError(f"optimizer state {key!r} of {s.fqn} is neither a tensor nor a number: "
                                      f"{type(v).__name__}; cannot save it")
        layout.param_state[s.fqn] = entry
    return tensors


def _group_entries(g, layout: GroupLayout, zopts, rank: int) -> list[tuple[str, torch.Tensor]]:
    weight = g.weight_shard
    entries = [(layout.weight_tensor, weight.detach())]
    if g.owned:  # See [Note: the on-disk layout] in _layout.py
        return entries + _param_state(zopts, g, layout, rank)
    for key, t in _optimizer_state(zopts, g, layout):
        entries.append((layout.state_tensor(key), t.detach()))
    return entries


def _streamed_entries(g, layout: GroupLayout, zopts) -> list[tuple[str, str, torch.dtype]] | None:
    """(file tensor, swap-file key, dtype) of each tensor of a group whose master and optimizer
    state stream from NVMe (larger than a staging slot: See [Note: bounded staging] in
    _mechanisms/nvme_stream.py); None for any other group. Its scalars go into ``layout``."""
    if not g.master_streams:
        return None
    swapped = frozenset(g.masters.swapped_state())
    return [(layout.weight_tensor, "master", g.master.dtype)] + [
        (layout.state_tensor(key), f"state.{key}", t.dtype) for key, t in _optimizer_state(zopts, g, layout, swapped)]


def _write_rank_file(tmp: Path, engine, zopts, groups: list[GroupLayout]) -> FileRecord:
    """Stream this rank's shards, one group at a time.

    Groups whose state rests in an NVMe swap file are brought in for the header pass
    and again for the write, so host memory stays at one group's state; a group larger
    than a staging slot is never brought in whole: the header pass needs only its shapes,
    and the write reads it piece by piece through the slots.
    """
    specs = []
    streamed: dict[int, list] = {}
    for layout, g in zip(groups, engine.groups):
        layout.state_tensors.clear()
        layout.state_scalars.clear()
        layout.param_state.clear()
        entries = _streamed_entries(g, layout, zopts)
        if entries is not None:
            streamed[id(g)] = entries
            specs.extend((n, dt, [g.shard_numel]) for n, _, dt in entries)
            continue
        with g.resident(write_back=False):
            specs.extend((n, t.dtype, [t.numel()]) for n, t in _group_entries(g, layout, zopts, engine.comm.rank))
    name = rank_file_name(engine.comm.rank, engine.comm.world_size)
    if streamed:
        engine.swap.wait_writes()  # the last step's write-backs: the pieces are read from the file
    with StreamWriter(tmp / name, specs, {"format": "pt"}) as w:
        for layout, g in zip(groups, engine.groups):
            if id(g) in streamed:
                for n, key, _ in streamed[id(g)]:
                    for piece in nvme_stream.pieces(engine.swap, g, "opt", key):
                        w.write(n, piece)
                continue
            with g.resident(write_back=False):
                for n, t in _group_entries(g, layout, zopts, engine.comm.rank):
                    w.write(n, t)
        digest, size = w.close()
    return FileRecord(name=name, sha256=digest, bytes=size, rank=engine.comm.rank)


def _managed_ids(engine) -> set[int]:
    return set(engine.managed)


def _buffers(model: torch.nn.Module, engine) -> list[tuple[str, torch.Tensor]]:
    """state_dict entries that are not sharded parameters (buffers, non-float parameters)."""
    managed = _managed_ids(engine)
    out = []
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in managed:
            continue
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"model.state_dict() entry {key!r} is a {type(t).__name__}, not a tensor; "
                                  "save it through extra_state instead")
        out.append((key, t.detach()))
    return out


def _write_buffers(tmp: Path, model, engine) -> FileRecord:
    entries = _buffers(model, engine)
    specs = [(k, t.dtype, list(t.shape)) for k, t in entries]
    with StreamWriter(tmp / BUFFERS_FILE, specs, {"format": "pt"}) as w:
        for k, t in entries:
            w.write(k, t)
        digest, size = w.close()
    return FileRecord(name=BUFFERS_FILE, sha256=digest, bytes=size)


def _write_extra_state(tmp: Path, extra_state: Any) -> tuple[dict | None, FileRecord | None]:
    if extra_state is None:
        return None, None
    try:
        if json.loads(json.dumps(extra_state)) == extra_state:
            return {"kind": "json", "value": extra_state}, None
    except (TypeError, ValueError):
        pass
    target = tmp / EXTRA_STATE_FILE
    with open(target, "wb") as f:
        torch.save(extra_state, f)
        f.flush()
        os.fsync(f.fileno())
    record = FileRecord(name=EXTRA_STATE_FILE, sha256=sha256_file(target), bytes=target.stat().st_size)
    return {"kind": "torch", "file": EXTRA_STATE_FILE}, record


def _metadata(model, engine, zopts, groups, files, extra_meta) -> Metadata:
    managed = {id(s.param): s.fqn for g in engine.groups for s in g.slots}
    keys = [[k, "param", managed[id(t)]] if id(t) in managed else [k, "buffer", k]
            for k, t in model.state_dict(keep_vars=True).items()]
    optimizers, scalers = [], []
    for zopt in zopts:
        opt = zopt.optimizer
        hyper = []
        for pg in opt.param_groups:
            hyper.append({k: v for k, v in ((k, jsonable(v)) for k, v in pg.items() if k != "params")
                          if v is not SKIP})
        optimizers.append({"class": type(opt).__name__, "module": type(opt).__module__, "param_groups": hyper})
        scalers.append(zopt.scaler.state_dict() if zopt.scaler.enabled else None)
    return Metadata(
        world_size=engine.comm.world_size, stage=engine.plan.stage, precision=str(engine.config.precision),
        groups=groups, params=describe_params(engine, model), state_dict_keys=keys, files=files,
        optimizer=optimizers[0] if optimizers else None, loss_scaler=scalers[0] if scalers else None,
        optimizers=optimizers or None, loss_scalers=scalers or None,
        extra_state=extra_meta, zero_strategy_version=__version__)



def _write_metadata(tmp: Path, meta: Metadata) -> None:
    with open(tmp / METADATA_FILE, "w") as f:
        f.write(metadata_json(meta))
        f.flush()
        os.fsync(f.fileno())

