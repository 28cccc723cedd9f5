"""Sharded, atomic save: every rank writes its own shards; rank 0 writes metadata and swaps.

[Note: atomic replacement]
1. rank 0 checks the target, creates ``.zero_strategy-save-<token>`` beside it (a random
   token of this save, see [Note: what a save may delete] in _owned.py) and broadcasts
   the token;
   every rank writes its file there, hashing it on the way, and fsyncs it;
2. ranks all-gather (file, digest, size) or their error: any error aborts on all
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

[Note: asynchronous saves]
``save_checkpoint(..., async_save=True)`` (or ``ZeroConfig(async_save=True)``, which every
front end's save goes through) splits the save at the moment the state is copied:

* on the caller's thread, step 1 runs as above (rank 0 makes the directory and broadcasts
  its token), then each rank copies what its files hold into host buffers in file order:
  its shards and optimizer state (on a GPU into pinned buffers, copied without blocking
  and waited for by the writer through an event; on the CPU a plain copy; NVMe-resident
  state is read through the swap file's staging slots into host buffers, as the
  synchronous save reads it, because the next step rewrites that file), rank 0 also the
  buffers and ``extra_state`` (serialized now). The ranks agree that staging worked
  (the owners' per-parameter state rides along) and rank 0 builds the metadata now, with
  the hyperparameters of this moment. Then ``save_checkpoint`` returns and training may
  change every tensor: the writer reads only the copies.
* a thread (``engine.background_save``, _mechanisms/background_save.py) writes the same
  files with the same ``StreamWriter`` and the same checksums, then runs steps 2 and 3
  (agreement, metadata last, the swap): the files are byte for byte the synchronous save's.
* the staged buffers are held only until written, and ``memory_report`` counts them under
  "staging"; ``async_save_staging_bytes`` bounds them: past it staging waits for the writer,
  so the save returns when all but that much is on disk. ``None``: one copy of the rank's files.
* the next save, ``load_checkpoint``, ``teardown`` and ``wait_for_save`` wait for the thread and
  raise its ``CheckpointError``; nothing is published when any rank failed, exactly as in a
  synchronous save, so a failed or killed asynchronous save leaves the previous checkpoint
  intact and loadable (the leftover directory is removed by the next save there).

[Note: the agreement of an asynchronous save]
Step 2's all-gather and step 3's agreement run on the writer thread while the main thread
trains, so they must not share a process group with training: a backend pairs the k-th
collective of each rank on a group, and the thread's all-gather would pair with a
gradient reduce-scatter issued at the same moment on another rank. Committing at the next
synchronization point of the main thread instead (the next save or step) would keep a
finished checkpoint unpublished until then, so a crash in between would lose it. So the
thread uses a gloo group of its own over the same ranks (``Collectives.background_channel``,
made on the first asynchronous save, on every rank's main thread, at the same point of the
program): gloo on the CPU whatever the training backend, since only small pickled objects
pass, and saves never overlap (each waits for the previous), so its collectives come in one
order on every rank. Hybrid sharding: the group holds the whole world; the replicas that do not
write join the agreement with nothing to add, so every rank learns the outcome.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path
from queue import Queue
from typing import Any

import torch

from .._engine.engine import refuse_while_offloaded
from .._mechanisms import nvme_stream
from .._model.gather import whole_model_pass
from .._version import __version__
from ..api import _engine_of
from ._layout import (BUFFERS_FILE, EXTRA_STATE_FILE, METADATA_FILE, SKIP, CheckpointError, FileRecord, GroupLayout,
                      Metadata, describe_groups, describe_params, dtype_name, is_checkpoint_dir, jsonable,
                      rank_file_name, resolve_zero_optimizers)
from ._experts import describe_experts, experts_file_entries, local_state_dict
from ._metadata_io import metadata_json
from ._owned import SAVE_PREFIX, OwnedDir, leftover_prefixes, remove_leftovers, save_dir
from .._mechanisms.safetensors_writer import DIGEST, DIGESTS
from ._safetensors_stream import StreamWriter
from ._sync import agree, describe

_rename = os.rename  # module-level so tests can interrupt a save between the renames


@torch.no_grad()
def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer=None,
                    extra_state: Any = None, *, async_save: bool | None = None) -> None:
    """Save ``model`` (and ``optimizer``'s state) as a sharded checkpoint directory at ``path``.

    Every rank must call it. ``optimizer``: the one ``setup`` returned (or None for
    weights only). ``extra_state``: anything of yours to resume with (step counter,
    scheduler or data-loader state); JSON-able values go into the metadata, others
    into ``extra_state.pt`` (torch.save). An existing checkpoint at ``path`` is
    replaced atomically; any other existing file or directory there is refused.

    ``async_save`` (default: the config's ``async_save``): return once this rank's shards
    are copied into host buffers and write them on a background thread; the checkpoint
    appears at ``path`` when they are all written (See [Note: asynchronous saves]). The
    previous asynchronous save is waited for first, and its failure raised here.
    """
    engine = _engine_of(model)
    engine.background_save.wait()  # See [Note: asynchronous saves]: one at a time, failures raised
    refuse_while_offloaded(engine.offloaded, "zero_strategy.save_checkpoint()", ("optim_states", "hp_params", "lp_params"))
    asynchronous = engine.config.async_save if async_save is None else async_save
    if not isinstance(asynchronous, bool):
        raise TypeError(f"save_checkpoint: async_save must be True, False or None (the config's), got {async_save!r}")
    if asynchronous:  # no release around it: the copies it keeps are the memory it needs, and it is fast
        _start_async_save(path, model, engine, optimizer, extra_state)
        return
    with whole_model_pass(engine):  # See [Note: releases where a phase ends]
        _save_across_groups(path, model, engine, optimizer, extra_state)


def wait_for_save(model: torch.nn.Module, *, release_buffers: bool = False) -> None:
    """Block until the model's asynchronous save (if any) is on disk, and raise its error if it failed.

    ``load_checkpoint``, the next ``save_checkpoint`` and ``teardown`` call it themselves; call it
    before reading a checkpoint from another process, or before ``destroy_process_group()``.
    Local to each rank (the save's own agreement already ran on its thread).
    ``release_buffers``: also free the host buffers kept for the next asynchronous save (See
    [Note: staging buffers kept] in _mechanisms/background_save.py); the next one allocates again.
    """
    background = _engine_of(model).background_save
    try:
        background.wait()
    finally:
        if release_buffers:
            background.release_buffers()


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


def _reserve_target(path: Path) -> tuple[tuple[str, str], OwnedDir | None]:
    """Rank 0's decision for a save to ``path``: ("ok", token of the temporary directory it created
    beside the target) or ("error", why), which every rank receives; synchronous and asynchronous
    saves start the same way."""
    try:
        _check_target(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        owned = OwnedDir.create(path.parent, SAVE_PREFIX)
        return ("ok", owned.token), owned
    except (OSError, CheckpointError) as err:
        return ("error", describe(err)), None


def _save_in_group(path, model, engine, optimizer, extra_state) -> None:
    comm = engine.comm
    zopts = resolve_zero_optimizers(engine, optimizer)
    path = Path(path).absolute()
    decision, owned = _reserve_target(path) if comm.rank == 0 else (None, None)
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
        experts = experts_file_entries(model, engine, zopts)  # See [Note: experts in a checkpoint] in _experts.py
        if experts is not None:
            records.append(_write_experts_file(tmp, engine, *experts))
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


def _rank_file_plan(engine, zopts, groups: list[GroupLayout]) -> tuple[str, list, dict[int, list]]:
    """The header pass of this rank's file: (file name, (tensor, dtype, shape) specs, the groups
    streamed from NVMe with their entries). Fills each layout's optimizer state description.

    Groups whose state rests in an NVMe swap file are brought in for the header pass (and again
    for the write, :func:`_rank_file_pieces`), so host memory stays at one group's state; a group
    larger than a staging slot is never brought in whole: the header pass needs only its shapes,
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
    return rank_file_name(engine.comm.rank, engine.comm.world_size), specs, streamed


def _rank_file_pieces(engine, zopts, groups: list[GroupLayout], streamed: dict[int, list]):
    """(tensor name, piece) in the order of :func:`_rank_file_plan`'s specs; a piece is valid until the next."""
    if streamed:
        engine.swap.wait_writes()  # the last step's write-backs: the pieces are read from the file
    for layout, g in zip(groups, engine.groups):
        if id(g) in streamed:
            for n, key, _ in streamed[id(g)]:
                for piece in nvme_stream.pieces(engine.swap, g, "opt", key):
                    yield n, piece
            continue
        with g.resident(write_back=False):
            for n, t in _group_entries(g, layout, zopts, engine.comm.rank):
                yield n, t


def _write_rank_file(tmp: Path, engine, zopts, groups: list[GroupLayout]) -> FileRecord:
    """Stream this rank's shards, one group at a time (see :func:`_rank_file_plan`)."""
    name, specs, streamed = _rank_file_plan(engine, zopts, groups)
    with StreamWriter(tmp / name, specs, {"format": "pt"}, held_by=engine.background_save) as w:
        for n, piece in _rank_file_pieces(engine, zopts, groups, streamed):
            w.write(n, piece)
        digest, size = w.close()
    return FileRecord(name=name, digest=digest, bytes=size, rank=engine.comm.rank)


def _write_experts_file(tmp: Path, engine, name: str, specs: list, entries: list) -> FileRecord:
    """This rank's experts, one tensor per expert (See [Note: experts in a checkpoint] in _experts.py)."""
    with StreamWriter(tmp / name, specs, {"format": "pt"}, held_by=engine.background_save) as w:
        for n, t in entries:
            w.write(n, t)
        digest, size = w.close()
    return FileRecord(name=name, digest=digest, bytes=size, rank=engine.comm.rank)


def _managed_ids(engine) -> set[int]:
    return set(engine.managed)


def _expert_ids(engine) -> frozenset[int]:
    return frozenset() if engine.expert_parallel is None else engine.expert_parallel.local_ids


def _buffers(model: torch.nn.Module, engine) -> list[tuple[str, torch.Tensor]]:
    """state_dict entries that are not sharded parameters (buffers, non-float parameters)."""
    managed = _managed_ids(engine) | _expert_ids(engine)
    out = []
    for key, t in local_state_dict(model, engine).items():
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
    with StreamWriter(tmp / BUFFERS_FILE, specs, {"format": "pt"}, held_by=engine.background_save) as w:
        for k, t in entries:
            w.write(k, t)
        digest, size = w.close()
    return FileRecord(name=BUFFERS_FILE, digest=digest, bytes=size)


def _write_extra_state(tmp: Path, extra_state: Any) -> tuple[dict | None, FileRecord | None]:
    extra_meta, data = _serialized_extra_state(extra_state)
    if data is None:
        return extra_meta, None
    return extra_meta, _write_bytes(tmp / EXTRA_STATE_FILE, data)


def _serialized_extra_state(extra_state: Any) -> tuple[dict | None, bytes | None]:
    """(its metadata entry, the bytes of ``extra_state.pt`` or None when it goes into the metadata)."""
    if extra_state is None:
        return None, None
    try:
        if json.loads(json.dumps(extra_state)) == extra_state:
            return {"kind": "json", "value": extra_state}, None
    except (TypeError, ValueError):
        pass
    buf = io.BytesIO()
    torch.save(extra_state, buf)
    return {"kind": "torch", "file": EXTRA_STATE_FILE}, buf.getvalue()


def _write_bytes(target: Path, data: bytes) -> FileRecord:
    with open(target, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(name=target.name, digest=f"{DIGEST}:{DIGESTS[DIGEST](data).hexdigest()}",
                      bytes=target.stat().st_size)


def _metadata(model, engine, zopts, groups, files, extra_meta) -> Metadata:
    managed = {id(s.param): s.fqn for g in engine.groups for s in g.slots}
    experts = describe_experts(model, engine, zopts)
    expert_fqn = {id(p): n for n, p in model.named_parameters()} if experts is not None else {}
    keys = [[k, "param", managed[id(t)]] if id(t) in managed else
            [k, "expert", expert_fqn[id(t)]] if id(t) in _expert_ids(engine) else [k, "buffer", k]
            for k, t in local_state_dict(model, engine).items()]
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
        extra_state=extra_meta, experts=experts, zero_strategy_version=__version__)



def _write_metadata(tmp: Path, meta: Metadata) -> None:
    with open(tmp / METADATA_FILE, "w") as f:
        f.write(metadata_json(meta))
        f.flush()
        os.fsync(f.fileno())



# ------------------------------------------------------------------ asynchronous saves
#: elements staged per host buffer at most: bounds the last piece that may exceed a small staging limit
STAGING_CHUNK_BYTES = 64 * 2**20
#: test hook: called on the writer thread before each queued item is written (block it, fail it, kill)
_before_background_write = None


def _start_async_save(path, model, engine, optimizer, extra_state) -> None:
    """Stage this rank's files into host buffers and hand them to a background thread.

    See [Note: asynchronous saves] and [Note: the agreement of an asynchronous save].
    """
    comm = engine.comm
    channel = comm.background_channel()  # every rank, main thread, at the same point
    bg = engine.background_save
    path = Path(path).absolute()
    if comm.replica_index != 0:  # hybrid: the first shard group writes; See [Note: hybrid checkpoints]
        bg.start(str(path), lambda _: _as_save_failure(path, _background_commit, channel, path, None, None, [], None))
        return
    zopts = resolve_zero_optimizers(engine, optimizer)
    decision, owned = _reserve_target(path) if comm.rank == 0 else (None, None)
    queue: Queue = Queue()
    started = False
    try:
        kind, value = comm.broadcast_object(decision, src_rank=0)
        if kind == "error":
            raise CheckpointError(value)
        tmp = save_dir(path.parent, value)
        bg.start(str(path), lambda bg: _as_save_failure(path, _background_write, bg, queue, channel, path, tmp, owned))
        started = True
        meta = _stage(queue, bg, tmp, model, engine, zopts, extra_state)
    except BaseException:
        if started:
            queue.put(("abort",))
            error = bg.wait(raise_error=False)
            if error is not None and not isinstance(error, CheckpointError):
                raise error
        if owned is not None:
            owned.remove()
        raise
    queue.put(("commit", meta))


def _stage(queue: Queue, bg, tmp: Path, model, engine, zopts, extra_state) -> Metadata | None:
    """Copy every file of this rank into host buffers, queued for the writer in file order; agree with
    the other ranks that staging worked; rank 0 returns the metadata without its file records."""
    comm = engine.comm
    groups = describe_groups(engine)
    error = extra_meta = None
    try:
        if not tmp.is_dir():  # See [Note: one filesystem for all ranks]
            raise CheckpointError(f"this rank cannot see {tmp}, the directory rank 0 created for the checkpoint "
                                  "just now: save_checkpoint needs one filesystem shared by every rank")
        limit = engine.config.async_save_staging_bytes
        name, specs, streamed = _rank_file_plan(engine, zopts, groups)
        queue.put(("open", name, specs, engine.comm.rank))
        _stage_pieces(queue, bg, limit, _rank_file_pieces(engine, zopts, groups, streamed))
        experts = experts_file_entries(model, engine, zopts)  # See [Note: experts in a checkpoint] in _experts.py
        if experts is not None:
            queue.put(("open", experts[0], experts[1], engine.comm.rank))
            _stage_pieces(queue, bg, limit, experts[2])
        if comm.rank == 0:
            entries = _buffers(model, engine)
            queue.put(("open", BUFFERS_FILE, [(k, t.dtype, list(t.shape)) for k, t in entries], None))
            _stage_pieces(queue, bg, limit, entries)
            extra_meta, data = _serialized_extra_state(extra_state)
            if data is not None:
                queue.put(("bytes", EXTRA_STATE_FILE, data))
        bg.keep_only_used()  # kept buffers this save did not take: the files changed shape
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        error = f"rank {comm.rank} could not stage its checkpoint file for {tmp}: {describe(err)}"
    owned_state = {layout.index: layout.param_state for layout in groups if layout.owned}
    gathered = comm.all_gather_object((error, owned_state))
    errors = [e for e, _ in gathered if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    if comm.rank != 0:
        return None
    for _, states in gathered:  # each owner recorded its own parameters' state
        for index, entries in states.items():
            groups[index].param_state.update(entries)
    return _metadata(model, engine, zopts, groups, [], extra_meta)  # hyperparameters as they are now


def _stage_pieces(queue: Queue, bg, limit: int | None, pieces) -> None:
    """Host copies of ``pieces`` (pinned where they come from a GPU), queued; waits for the writer
    while ``limit`` bytes are staged. See [Note: asynchronous saves]."""
    for name, piece in pieces:
        flat = piece.detach().reshape(-1)
        step = max(1, min(STAGING_CHUNK_BYTES, limit or STAGING_CHUNK_BYTES) // max(1, flat.element_size()))
        for start in range(0, max(1, flat.numel()), step):
            chunk = flat[start:start + step]
            bg.room_for(chunk.numel() * chunk.element_size(), limit)
            on_gpu = chunk.device.type == "cuda"
            host = bg.buffer(chunk.numel(), chunk.dtype, pinned=on_gpu)  # See [Note: staging buffers kept]
            host.copy_(chunk, non_blocking=on_gpu)
            event = None
            if on_gpu:
                event = torch.cuda.Event()
                event.record()
            bg.stage(host)
            queue.put(("piece", name, host, event))


def _background_write(bg, queue: Queue, channel, path: Path, tmp: Path, owned: OwnedDir | None) -> None:
    """The writer thread: write what is queued, then commit with the other ranks (or stop on abort)."""
    records: list[FileRecord] = []
    error = None
    writer = None
    rank = None
    try:
        while True:
            item = queue.get()
            if item[0] in ("commit", "abort"):
                break
            try:
                if error is None and _before_background_write is not None:
                    _before_background_write(item)
                if item[0] == "piece":
                    _, name, host, event = item
                    if error is None:
                        if event is not None:
                            event.synchronize()
                        writer.write(name, host)
                    bg.drop(host)
                elif error is not None:
                    continue
                elif item[0] == "open":
                    records.extend(_close(writer, rank))
                    _, name, specs, rank = item
                    writer = StreamWriter(tmp / name, specs, {"format": "pt"}, held_by=bg)
                elif item[0] == "bytes":
                    records.extend(_close(writer, rank))
                    writer = None
                    records.append(_write_bytes(tmp / item[1], item[2]))
            except Exception as err:  # noqa: BLE001 - agreed on with every rank at the commit
                error = f"rank {_rank_of(channel)} could not write its checkpoint file in {tmp}: {describe(err)}"
                if item[0] == "piece":
                    bg.drop(item[2])
        if item[0] == "abort":  # staging failed somewhere: every rank stops, nothing to agree on
            return
        if error is None:
            try:
                records.extend(_close(writer, rank))
                writer = None
            except Exception as err:  # noqa: BLE001
                error = f"rank {_rank_of(channel)} could not write its checkpoint file in {tmp}: {describe(err)}"
        _background_commit(channel, path, owned, item[1], records, error)
    finally:
        if writer is not None:
            writer.abort()
        if owned is not None:
            owned.remove()  # a no-op once the directory became the checkpoint


def _as_save_failure(path: Path, job, *args) -> None:
    """Run ``job(*args)``; any failure becomes the CheckpointError the next wait raises, naming the save."""
    try:
        job(*args)
    except Exception as err:  # noqa: BLE001 - See [Note: no silent background failure]
        raise CheckpointError(f"the asynchronous save of {path} failed (nothing was published there: a "
                              f"previous checkpoint at that path is intact): {describe(err)}") from err


def _close(writer, rank) -> list[FileRecord]:
    if writer is None:
        return []
    digest, size = writer.close()
    return [FileRecord(name=writer.path.name, digest=digest, bytes=size, rank=rank)]


def _rank_of(channel) -> int:
    return 0 if channel is None else channel.rank


def _background_commit(channel, path: Path, owned: OwnedDir | None, meta: Metadata | None,
                       records: list[FileRecord], error: str | None) -> None:
    """Steps 2 and 3 of [Note: atomic replacement], on the writer thread, over ``channel``."""
    gathered = [(records, error)] if channel is None else channel.all_gather_object((records, error), label="async save")
    errors = [e for _, e in gathered if e]
    if errors:
        raise CheckpointError("; ".join(errors))
    error = None
    if owned is not None:  # rank 0 of the first shard group
        try:
            files = [r for recs, _ in gathered for r in recs]
            _write_metadata(owned.path, dataclasses.replace(meta, files=files))
            _swap_into_place(owned, path)
        except Exception as err:  # noqa: BLE001
            error = f"rank 0 could not finish the checkpoint at {path}: {describe(err)}"
    if channel is None:
        if error:
            raise CheckpointError(error)
        return
    agree(channel, error if owned is not None else None)
