"""Load a checkpoint into a set-up model on any world size and any stage.

[Note: re-sharding by name]
The running model's flat groups need not match the saved ones (other world size,
stage, persistence threshold or frozen set). For each running group, each rank
walks the slots intersecting its own shard, looks the parameter up by name in the
checkpoint layout, and reads just the elements it owns from the one or more saved
rank files that hold them (``readinto`` at the element range; See [Note: one copy into the shard]): memory stays
at one shard, and no rank reads what it does not keep. Master shards, frozen
shards and elementwise optimizer state all move this way; scalar optimizer state
(``step``) and hyperparameters come from the metadata. Afterwards the compute-dtype
parameters are rebuilt from the masters exactly as after an optimizer step (copy
into the parameter shard, all-gather where parameters are replicated).

[Note: verify, agree, then copy]
A refused load leaves the model, its optimizer and its buffers exactly as they were, on
every rank (SECURITY.md): a user who catches the error and trains on must train the model
they had, not one half from the checkpoint. So a load has two phases. *Prepare*
(:func:`prepare_load`) copies nothing into the model: it reads the metadata, compares
names, shapes and the saved optimizer state with the running ones, checks the
hyperparameters and the buffers' shapes, verifies every file this rank will read (digest
and size, then its safetensors header against the metadata) and opens it, and reads the
extra state. Its errors are agreed on across ranks (one ``all_gather_object`` of each
rank's error or None), so either every rank goes on or every rank raises the same
``CheckpointError``, before any rank has copied a value: at the same world size rank 0
never reads rank 1's file, and without the agreement it had loaded all of its own when
rank 1 refused. *Commit* (:meth:`PreparedLoad.commit`) only copies, through the handles
prepare opened (a file replaced since then is still read as verified). Nothing the model or
optimizer holds is staged: memory stays at one shard. A resume's optimizer state is read once,
into the fresh tensors the commit installs, while its file is hashed (See [Note: one pass over
the optimizer state] in _one_pass.py); the rest of a file is read twice, once to hash it and once
to copy from the page cache it filled.

A DeepSpeed checkpoint (See [Note: DeepSpeed's layout] in _deepspeed.py) goes through the same
two phases: prepare reads every rank file (memory-mapped, through the allowlisted unpickler),
checks its layout and the model, optimizer and hyperparameters against it, and
``DeepSpeedLoad`` (_deepspeed_load.py) only copies. So does a torch.distributed.checkpoint (DCP) directory of an
FSDP2 run (See [Note: DCP's layout] in _dcp.py, [Note: other systems' formats]): prepare reads
every chunk this rank will copy from, once, and ``DCPLoad`` (_dcp_load.py) copies.

What commit can still meet is the disk failing under it, or a file written over in place
by another process between the phases. Such an error is agreed on too (no rank hangs),
and its message says the model is partly loaded.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from .._engine.engine import refuse_while_offloaded
from .._mechanisms.background_save import join_saves_to
from .._mechanisms import nvme_stream
from .._model.gather import whole_model_pass
from .._optim.chunked_step import stopped_part_way
from ..api import _engine_of
from ._layout import BUFFERS_FILE, METADATA_FILE, CheckpointError, Metadata, dtype_from_name, resolve_zero_optimizers
from ._metadata_io import read_metadata
from ._one_pass import Run, aligned_like
from ._safetensors_stream import StreamReader, check_file, verify_file
from ._sync import agree, describe
from ._experts import expert_files, experts_to_read, fill_flat_from_experts, load_experts, local_state_dict
from ._validate import check_buffers_file, check_experts_file, check_rank_file


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """``path``, or the previous checkpoint a save interrupted between its two renames left beside it."""
    path = Path(path).absolute()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file, not a zero_strategy checkpoint directory")
        return path
    olds = [p for p in old_checkpoints(path) if (p / "metadata.json").is_file()]
    if not olds:
        raise CheckpointError(f"no checkpoint at {path}")
    newest = max(olds, key=lambda p: (p / "metadata.json").stat().st_mtime)
    warnings.warn(f"{path} is missing but {newest.name} beside it is a complete checkpoint left by an "
                  "interrupted save; loading that one", stacklevel=3)
    return newest


def old_checkpoints(path: Path) -> list[Path]:
    """``<path>.old-<token>`` directories beside ``path`` (exact names, never a pattern over user names)."""
    pattern = re.compile(re.escape(path.name) + r"\.old-[0-9a-f]{12}")
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return []
    return [p for p in entries if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]


class _Reader:
    """Saved files verified and opened by :meth:`verify`; reads element ranges of their tensors."""

    def __init__(self, ckpt_dir: Path, meta: Metadata):
        self.dir, self.meta = ckpt_dir, meta
        self._open: dict[str, Any] = {}
        #: rank files opened for plain reads straight into the shards (See [Note: one copy into the shard])
        self._streams: dict[str, StreamReader] = {}
        #: buffer name -> (dtype name, shape) from the buffers file's header, once verified
        self.buffer_header: dict[str, tuple[str, list[int]]] = {}
        #: id(group) -> its optimizer state, read during the verification (See [Note: one pass over
        #: the optimizer state] in _one_pass.py); installed by the commit, dropped by a refusal
        self.read_ahead: dict[int, dict[str, Any]] = {}

    def verify(self, names: set[str], plan: Callable[[dict[str, StreamReader]], dict[str, list[Run]]] | None = None
               ) -> None:
        """Check each file against the metadata (digest, size, header) and open it. See [Note: verify,
        agree, then copy]. ``plan(streams)``: the byte runs of each rank file to read into fresh
        tensors while it is hashed (See [Note: one pass over the optimizer state] in _one_pass.py)."""
        from safetensors import safe_open

        rank_files = [n for n in sorted(names) if n != BUFFERS_FILE and not self._experts_file(n)]
        for name in rank_files:  # their headers first: the plan needs their offsets
            rec = self.meta.file(name)
            check_file(self.dir / name, rec.digest, rec.bytes)
            try:
                check_rank_file(self.dir / name, self.meta)
                self._streams[name] = StreamReader(self.dir / name)
            except CheckpointError:
                verify_file(self.dir / name, rec.digest, rec.bytes)  # a damaged file is called so first
                raise
        runs = plan(self._streams) if plan is not None else {}
        for name in sorted(names):
            rec = self.meta.file(name)
            stream = self._streams.get(name)
            if stream is None:
                verify_file(self.dir / name, rec.digest, rec.bytes)
            else:
                verify_file(self.dir / name, rec.digest, rec.bytes, stream.fileno(), runs.get(name))
            if name == BUFFERS_FILE:
                self.buffer_header = check_buffers_file(self.dir / name, self.meta)
            elif self._experts_file(name):
                check_experts_file(self.dir / name, self.meta)
            try:
                self._open[name] = safe_open(str(self.dir / name), framework="pt")
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"checkpoint file {self.dir / name} is unreadable: {err}") from None

    def _experts_file(self, name: str) -> bool:
        return self.meta.experts is not None and name in expert_files(self.meta.experts)

    def handle(self, name: str):
        try:
            return self._open[name]
        except KeyError:  # _files_to_read missed it: a bug, never a file read unverified
            raise CheckpointError(f"internal error: {name} is read but was not verified first") from None

    def fill(self, dst: torch.Tensor, fqn: str, lo: int, hi: int, tensor_of) -> None:
        """dst[0:hi-lo] <- elements [lo, hi) of parameter ``fqn``; ``tensor_of(group)`` names the tensor.

        [Note: one copy into the shard]
        Elements are read with ``readinto`` through the rank file's descriptor opened when it was
        verified, straight into ``dst`` where it is a contiguous CPU tensor of the stored dtype (a
        master shard, a CPU optimizer state): one copy from the page cache the verification
        filled. Through ``safe_open``'s memory map it was a page fault per 4 KiB, a new tensor and
        a second copy (0.6-1.4 s of a 1.3 GB rank file's load on the benchmark machine).
        Elsewhere (a GPU shard, another dtype) a fresh buffer is read and copied.
        """
        group = self.meta.groups[self.meta.params[fqn].group]
        for rank, a, b, at in self.meta.pieces(fqn, lo, hi):
            name = self.meta.rank_file(rank)
            stream = self._streams.get(name)
            if stream is None:  # _files_to_read missed it: a bug, never a file read unverified
                raise CheckpointError(f"internal error: {name} is read but was not verified first")
            stream.read_into(tensor_of(group), a, b, dst[at:at + b - a])

    def tensor(self, rank: int, name: str) -> torch.Tensor:
        """The whole tensor ``name`` of rank file ``rank`` (per-parameter optimizer state)."""
        return self.handle(self.meta.rank_file(rank)).get_tensor(name)

    def close(self) -> None:
        self._open.clear()
        self.read_ahead.clear()
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()


@torch.no_grad()
def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer=None, strict: bool = True, *,
                    lr_scheduler=None) -> Any:
    """Load a checkpoint saved by :func:`save_checkpoint` into a set-up model; return ``extra_state``.

    Works on any world size and stage. Every rank must call it. ``optimizer``: the one
    ``setup`` returned, to restore its state, hyperparameters and the loss scale (None:
    weights only). ``strict=False`` tolerates parameters or buffers missing on either
    side (with a warning) instead of raising. ``lr_scheduler``: a scheduler to restore too
    (``load_state_dict``): from a DeepSpeed checkpoint, the state of the scheduler its engine had;
    from ours, the ``"lr_scheduler"`` entry of a dict ``extra_state`` (save it so:
    ``extra_state={"lr_scheduler": scheduler.state_dict(), ...}``). A checkpoint without one, or
    with another scheduler class's state, is refused. A load refused by its checks (a damaged,
    edited or mismatched checkpoint) has changed nothing, on any rank (See [Note: verify, agree,
    then copy]).
    """
    with prepare_load(path, model, optimizer, strict, lr_scheduler=lr_scheduler) as load:
        return load.commit()


class PreparedLoad:
    """A checkpoint load whose every check passed on every rank; nothing is copied before :meth:`commit`.

    A context manager: leaving it without committing closes the files. Front ends that restore
    other state too prepare first, so a refused checkpoint stops them before anything changes.
    """

    def __init__(self, path, model, engine, zopts: list, reader: _Reader, names, buffers: list[str],
                 hyper: list, extra: Any):
        self.path, self.model, self.engine, self.zopts = path, model, engine, zopts
        self.reader, self.names, self.buffers, self.hyper = reader, names, buffers, hyper
        #: the saved ``extra_state`` (what ``accept_extra`` made of it)
        self.extra = extra

    def __enter__(self) -> "PreparedLoad":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.reader.close()

    @torch.no_grad()
    def commit(self) -> Any:
        """Copy the checkpoint into the model and optimizer (every rank); return the extra state."""
        error = None
        with whole_model_pass(self.engine):  # See [Note: releases where a phase ends]
            try:
                self._copy()
            except Exception as err:  # noqa: BLE001 - agreed on below, raised on every rank
                error = (f"cannot load checkpoint {self.path}: {describe(err)} (while copying, after every check "
                         "had passed: the model and optimizer are partly loaded; load a checkpoint again before "
                         "training)")
            finally:
                self.close()
            agree(self.engine.comm, error)
            _publish(self.engine, streamed=self.streams_groups)
        for zopt, (updates, scaler) in zip(self.zopts, self.hyper):
            _apply_hyperparameters(updates)
            if scaler is not None and zopt.scaler.enabled:
                zopt.scaler.load_state_dict(scaler)
        if self.lr_scheduler is not None:  # after the hyperparameters: it may set the groups' lr itself
            self.lr_scheduler[0].load_state_dict(self.lr_scheduler[1])
        return self.extra

    #: (the scheduler, its saved state) to restore at the commit, or None
    lr_scheduler: tuple | None = None

    #: streamed groups are loaded and published chunk by chunk (See [Note: a streamed resume])
    streams_groups = True

    def _copy(self) -> None:
        """The copy itself, every check passed: shards, optimizer state, buffers."""
        _load_shards(self.reader, self.names, self.engine, self.zopts)
        if self.engine.expert_parallel is None and self.reader.meta.experts is not None:
            fill_flat_from_experts(self.reader.handle, self.reader.meta, self.model, self.engine)
        load_experts(self.reader.handle, self.reader.meta, self.model, self.engine, self.zopts)
        _load_buffers(self.reader, self.model, self.buffers)


# [Note: other systems' formats]
# A reader of another system's checkpoint directory builds on PreparedLoad (its own subclass
# copies) and on this module's checks, so this module cannot import it: it registers itself
# here, when the package imports it, as (recognizes(dir) -> bool, prepare(dir, names, buffers,
# model, engine, zopts, strict) -> (reader, buffers, hyper, extra, PreparedLoad subclass)).
# prepare runs inside prepare_load's agreed phase. DCP (_dcp_load.py) is one.
_OTHER_FORMATS: list[tuple[Callable[[Path], bool], Callable]] = []


def register_format(recognizes: Callable[[Path], bool], prepare: Callable) -> None:
    """Let :func:`load_checkpoint` read another system's checkpoint directories. See [Note: other systems' formats]."""
    _OTHER_FORMATS.append((recognizes, prepare))


@torch.no_grad()
def prepare_load(path: str | Path, model: torch.nn.Module, optimizer=None, strict: bool = True,
                 accept_extra: Callable[[Any], Any] | None = None, *, lr_scheduler=None) -> PreparedLoad:
    """Every check of a load, on every rank, agreed on; nothing copied. See [Note: verify, agree, then copy].

    ``accept_extra(extra_state)``: a front end's own check of the saved extra state, run here so
    that a refusal of it also leaves everything as it was; its result is ``PreparedLoad.extra``.
    Where it raises, that rank raises its exception, the other ranks a ``CheckpointError``.
    """
    engine = _engine_of(model)
    engine.background_save.wait()  # an asynchronous save in flight first (See [Note: asynchronous saves])
    join_saves_to(str(Path(path).absolute()))  # another model's save to this path (a new run resuming)
    refuse_while_offloaded(engine.offloaded, "zero_strategy.load_checkpoint()", ("optim_states", "hp_params", "lp_params"))
    zopts = resolve_zero_optimizers(engine, optimizer)
    error, own, reader, prepared = None, None, None, None
    try:
        ckpt_dir = resolve_checkpoint_dir(path)
        names, buffers = _model_names(model, engine)
        ours = (ckpt_dir / METADATA_FILE).exists()
        other = None if ours else next((prepare for recognizes, prepare in _OTHER_FORMATS if recognizes(ckpt_dir)),
                                       None)
        if engine.expert_parallel is not None and not ours:  # See [Note: experts in a checkpoint] in _experts.py
            raise CheckpointError(
                f"{ckpt_dir} is not a zero_strategy checkpoint (a DeepSpeed or torch.distributed.checkpoint "
                f"directory): loading one into a model set up with expert_parallel_size={engine.expert_parallel.size} "
                "is not supported; resume it without expert_parallel_size")
        if other is not None:  # See [Note: other systems' formats]
            reader, buffers, hyper, extra, kind = other(ckpt_dir, names, buffers, model, engine, zopts, strict)
        else:
            meta = read_metadata(ckpt_dir)
            experts = experts_to_read(meta, model, engine, zopts, ckpt_dir)  # See [Note: experts in a checkpoint]
            _check_compatible(meta, names, buffers, engine, zopts, strict, ckpt_dir)
            saved_all = zip(zopts, _saved_optimizers(meta), _saved_scalers(meta))
            hyper = [(_hyperparameter_updates(saved, zopt, ckpt_dir / METADATA_FILE, i), scaler)
                     for i, (zopt, saved, scaler) in enumerate(saved_all)]
            saved_buffers = set(meta.buffer_keys())
            buffers = [k for k in buffers if k in saved_buffers]
            reader = _Reader(ckpt_dir, meta)
            ahead = _ReadAhead(reader, engine, zopts, names)  # See [Note: one pass over the optimizer state]
            reader.verify(_files_to_read(meta, names, engine, zopts) | experts | ({BUFFERS_FILE} if buffers else set()),
                          ahead)
            ahead.finish()
            _check_buffer_shapes(reader, model, buffers)
            extra, kind = _extra_state(reader, meta), PreparedLoad
        scheduler_state = None
        if lr_scheduler is not None:
            # a format that keeps the scheduler apart from its extra state (DeepSpeed's) reads it itself
            own_scheduler = getattr(reader, "lr_scheduler_state", None)
            saved = own_scheduler() if own_scheduler is not None else \
                (extra.get("lr_scheduler") if isinstance(extra, dict) else None)
            scheduler_state = (lr_scheduler, _check_scheduler_state(lr_scheduler, saved, ckpt_dir))
        if accept_extra is not None:
            try:
                extra = accept_extra(extra)
            except Exception as err:  # noqa: BLE001 - re-raised as is on this rank, below
                own = err
                raise
        prepared = kind(path, model, engine, zopts, reader, names, buffers, hyper, extra)
        prepared.lr_scheduler = scheduler_state
    except Exception as err:  # noqa: BLE001 - agreed on below, raised on every rank
        error = f"cannot load checkpoint {path}: {describe(err)}"
        if reader is not None:
            reader.close()
    try:
        agree(engine.comm, error)
    except CheckpointError:
        if prepared is not None:
            prepared.close()
        if own is not None:
            raise own from None  # the front end's own refusal, with its type, where it was raised
        raise
    return prepared


def _check_scheduler_state(lr_scheduler, saved: Any, ckpt_dir: Path) -> dict:
    """The saved scheduler state that ``lr_scheduler`` can take: refused when there is none, or when
    its keys are another scheduler class's (``load_state_dict`` would take any dict silently)."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ckpt_dir} holds no LR scheduler state to restore lr_scheduler from (a DeepSpeed "
                              "run without a scheduler, or a checkpoint of ours whose extra_state has no "
                              "'lr_scheduler' entry)")
    here = set(lr_scheduler.state_dict())
    if set(saved) != here:
        raise CheckpointError(f"{ckpt_dir}: the saved LR scheduler state has keys {sorted(saved)}, "
                              f"{type(lr_scheduler).__name__} has {sorted(here)}: saved by another scheduler class")
    return saved


def _saved_optimizers(meta: Metadata) -> list:
    if meta.optimizers is not None:
        return meta.optimizers
    return [meta.optimizer] if meta.optimizer is not None else []


def _saved_scalers(meta: Metadata) -> list:
    if meta.loss_scalers is not None:
        return meta.loss_scalers
    return [meta.loss_scaler] * len(_saved_optimizers(meta))


# ------------------------------------------------------------------ checks
def _model_names(model, engine) -> tuple[dict[int, list[str]], list[str]]:
    from ._layout import param_names

    names = param_names(model)
    managed = engine.managed
    ep = engine.expert_parallel
    experts = ep.local_ids if ep is not None else frozenset()  # their own file: See [Note: experts in a checkpoint]
    buffers = [k for k, t in local_state_dict(model, engine).items() if id(t) not in managed and id(t) not in experts]
    return {pid: n for pid, n in names.items() if pid in managed}, buffers


def _refuse_or_warn_unmatched(ckpt_dir, missing: list, unexpected: list, strict: bool) -> None:
    """Names in the model but not the checkpoint, or the other way: refused under ``strict``,
    else a warning (the rest loads), as torch's ``load_state_dict`` treats them."""
    if not (missing or unexpected):
        return
    msg = (f"{ckpt_dir} does not match the model: missing from the checkpoint: {missing or 'none'}; "
           f"in the checkpoint but not in the model: {unexpected or 'none'}")
    if strict:
        raise CheckpointError(msg + " (strict=False loads the rest)")
    warnings.warn(msg, stacklevel=5)


def _check_compatible(meta: Metadata, names, buffers, engine, zopts, strict: bool, ckpt_dir: Path) -> None:
    alias = meta.alias_map()
    model_keys = {n for ns in names.values() for n in ns} | set(buffers)
    ckpt_keys = set(alias) | set(meta.buffer_keys())
    if engine.expert_parallel is None:  # their weights go into the flat groups: See [Note: experts in a checkpoint]
        ckpt_keys |= {k for k, kind, _ in meta.state_dict_keys if kind == "expert"}
    missing, unexpected = sorted(model_keys - ckpt_keys), sorted(ckpt_keys - model_keys)
    mismatched = []
    for g in engine.groups:
        for s in g.slots:
            fqn = _fqn_in_checkpoint(alias, names[id(s.param)])
            if fqn is not None and list(meta.params[fqn].shape) != list(s.shape):
                mismatched.append(f"{s.fqn}: checkpoint {tuple(meta.params[fqn].shape)}, model {tuple(s.shape)}")
    if mismatched:
        raise CheckpointError(f"{ckpt_dir}: parameter shapes differ: {mismatched}")
    _refuse_or_warn_unmatched(ckpt_dir, missing, unexpected, strict)
    if not zopts:
        return
    saved_all = _saved_optimizers(meta)
    if not saved_all:
        raise CheckpointError(f"{ckpt_dir} was saved without optimizer state; pass optimizer=None to load "
                              "the model weights only (the optimizer then starts fresh)")
    if len(saved_all) != len(zopts):
        raise CheckpointError(f"{ckpt_dir} holds the state of {len(saved_all)} optimizer(s), but "
                              f"{len(zopts)} were given")
    for zopt, saved_opt in zip(zopts, saved_all):
        have, saved = type(zopt.optimizer).__name__, saved_opt["class"]
        if have != saved:
            raise CheckpointError(f"{ckpt_dir} holds {saved} optimizer state but the optimizer is {have}")
        if len(saved_opt["param_groups"]) != len(zopt.optimizer.param_groups):
            raise CheckpointError(f"{ckpt_dir} has {len(saved_opt['param_groups'])} optimizer param groups, "
                                  f"the optimizer {len(zopt.optimizer.param_groups)}")


# ------------------------------------------------------------------ shards
def _fqn_in_checkpoint(alias: dict[str, str], names: list[str]) -> str | None:
    """The checkpoint's name for a parameter registered under ``names`` (None: not in it)."""
    return next((alias[n] for n in names if n in alias), None)


def _load_shards(reader: _Reader, names, engine, zopts) -> None:
    alias = reader.meta.alias_map()
    for g in engine.groups:
        if g.master_streams:  # See [Note: a streamed resume]
            _load_streamed_group(reader, g, zopts[g.optimizer_index] if zopts else None, names, alias)
            continue
        with g.resident(write_back=True):  # NVMe-swapped state comes in, and goes back loaded
            _load_group(reader, g, zopts, names, alias)


# [Note: a streamed resume]
# A flat group whose master and optimizer state are larger than an NVMe staging slot is
# stepped and saved chunk by chunk (See [Note: bounded staging] in _mechanisms/nvme_stream.py),
# but a load used to bring it in whole: the group's master, its state rebuilt as whole
# tensors, and then the whole set again to publish the parameters. On the 748M model that
# was 0.30-0.34 W per rank on resume, above training's bound. Now a load goes the way the
# group's first step does: the saved state's keys join the swap set evicted
# (``nvme_stream.register``), and one stream over the set's chunks [a, b) reads the master's
# chunk (a parameter the checkpoint lacks keeps its value, as strict=False promises), copies
# the checkpoint's elements of master and state into the chunk's views (the state's padding
# zero, as a whole-tensor load leaves it), writes the chunk back, and casts the master's chunk
# into the parameter shard (``take_master``, chunk by chunk into the parameter swap set at
# stage 3). So a resume holds the slots and one source tensor, as the step does, and the
# group is published when the stream ends (its all-gather at stages 1-2).


def _chunk_ranges(g, a: int, b: int):
    """(slot, lo, hi, where) of ``slot_ranges_in_shard`` clipped to shard elements [a, b), ``where``
    relative to ``a``: the part of each parameter that a chunk of the shard holds."""
    for s, lo, hi, where in g.slot_ranges_in_shard():
        x0, x1 = max(where.start, a), min(where.stop, b)
        if x0 < x1:
            yield s, lo + (x0 - where.start), lo + (x1 - where.start), slice(x0 - a, x1 - a)


def _load_streamed_group(reader: _Reader, g, zopt, names, alias) -> None:
    """Master, optimizer state and parameter shard of a streamed group from the checkpoint, one
    chunk at a time. See [Note: a streamed resume]."""
    masters, master = g.masters, g.master
    sources = {id(s.param): _fqn_in_checkpoint(alias, names[id(s.param)]) for s in g.slots}
    state: dict[str, Any] = {}
    state_keys: dict[str, torch.dtype] = {}
    if zopt is not None:
        zopt.optimizer.state.pop(master, None)
        found = _flat_state_sources(reader.meta, g, names, alias)
        first = reader.meta.groups[reader.meta.params[found[0][1]].group] if found else None
        if first is not None and (first.state_tensors or first.state_scalars):
            state_keys = {key: dtype_from_name(dname) for key, dname in first.state_tensors.items()}
            for key, dt in state_keys.items():  # evicted, to be written chunk by chunk
                state[key] = torch.empty(0, dtype=dt, device=master.device)
                nvme_stream.register(masters.swap, g, "opt", f"state.{key}", state[key], g.shard_numel)
            for key, sc in first.state_scalars.items():
                state[key] = (torch.tensor(sc["value"], dtype=dtype_from_name(sc["dtype"]),
                                           device=master.device if sc["on_param_device"] else "cpu")
                              .reshape(sc["shape"]) if sc["tensor"] else sc["value"])
    chunks = masters.stream(fresh=True)  # the master read; the state's chunks are written whole
    try:
        with contextlib.closing(chunks):
            for a, b, views in chunks:
                for key in state_keys:
                    views[f"state.{key}"].zero_()
                for s, lo, hi, where in _chunk_ranges(g, a, b):
                    fqn = sources[id(s.param)]
                    if fqn is None:
                        continue  # missing: allowed by strict=False, keeps its value and state
                    reader.fill(views["master"][where], fqn, lo, hi, lambda grp: grp.weight_tensor)
                    for key in state_keys:
                        reader.fill(views[f"state.{key}"][where], fqn, lo, hi,
                                    lambda grp, key=key: grp.state_tensor(key))
                event = g.params.take_master(views["master"], g.transfers, start=a)
                if event is not None:
                    event.wait()
    except BaseException as e:
        raise stopped_part_way(masters, f"flat group {g.name!r}, loaded in chunks", e) from e
    finally:
        master.data = torch.empty(0, dtype=master.dtype, device=master.device)
    masters.swap.wait_writes()
    if state:
        zopt.optimizer.state[master] = state


def _load_group(reader: _Reader, g, zopts, names, alias) -> None:
    target = g.weight_shard
    for s, lo, hi, where in g.slot_ranges_in_shard():
        fqn = _fqn_in_checkpoint(alias, names[id(s.param)])
        if fqn is None:
            continue  # missing: allowed by strict=False, keeps its current value
        dst = target[where]
        reader.fill(dst, fqn, lo, hi, lambda grp: grp.weight_tensor)
    if zopts and g.trainable and g.owned:
        _load_param_state(reader, g, zopts[g.optimizer_index], names, alias)
        # the rebuilt per-parameter state rests where the master does (NVMe: See [Note: the
        # ownership layout on NVMe] in _optim/owned_runs.py)
        g.masters.track_optimizer_state(zopts[g.optimizer_index].swappable_state(g), replace=True)
    elif zopts and g.trainable:
        zopt = zopts[g.optimizer_index]
        _load_optimizer_state(reader, g, zopt, names, alias)
        # the rebuilt state tensors rest where the master does from now on (NVMe: the swap file)
        g.masters.track_optimizer_state(zopt.optimizer.state.get(g.master, {}), replace=True)


def _files_to_read(meta: Metadata, names, engine, zopts) -> set[str]:
    """The rank files this rank's copy will read; on the way, the checks of the saved optimizer
    state that the copy used to meet half way (See [Note: verify, agree, then copy])."""
    alias = meta.alias_map()
    files: set[str] = set()
    for g in engine.groups:
        for s, lo, hi, _ in g.slot_ranges_in_shard():
            fqn = _fqn_in_checkpoint(alias, names[id(s.param)])
            if fqn is not None:  # the weights, and the flat layout's state: the same element ranges
                files.update(meta.rank_file(rank) for rank, *_ in meta.pieces(fqn, lo, hi))
        if zopts and g.trainable and g.owned:
            sources = _param_state_sources(meta, g, zopts[g.optimizer_index], names, alias)
            files.update(meta.rank_file(entry["rank"]) for _, _, entry in sources if entry is not None)
        elif zopts and g.trainable:
            _flat_state_sources(meta, g, names, alias)
    return files


def _flat_state_sources(meta: Metadata, g, names, alias) -> list:
    """(slot, checkpoint fqn) of a flat group's slots the checkpoint has; refuses saved state that
    cannot become this group's."""
    sources = [(s, _fqn_in_checkpoint(alias, names[id(s.param)])) for s in g.slots]
    sources = [(s, fqn) for s, fqn in sources if fqn is not None]
    first = meta.groups[meta.params[sources[0][1]].group] if sources else None
    for s, fqn in sources:
        grp = meta.groups[meta.params[fqn].group]
        if grp.param_state:
            raise _layout_changed(s.fqn, "whole parameters (the ownership layout)", "flat shards")
        if not grp.trainable:
            raise _frozen_in_checkpoint(s.fqn)
        if grp.state_tensors != first.state_tensors or set(grp.state_scalars) != set(first.state_scalars):
            raise CheckpointError(f"{s.fqn} and {sources[0][0].fqn} share a group here but their saved "
                                  "optimizer state has different entries")
    return sources


def _frozen_in_checkpoint(fqn: str) -> CheckpointError:
    return CheckpointError(f"{fqn} is trainable here but was frozen in the checkpoint: it has no "
                           "optimizer state (load with optimizer=None, or freeze it again)")


def _load_optimizer_state(reader: _Reader, g, zopt, names, alias) -> None:
    """Rebuild ``optimizer.state[master]`` for one running group from the saved groups of its slots
    (checked by :func:`_flat_state_sources` before the copy began), or install the state the
    verification read (See [Note: one pass over the optimizer state] in _one_pass.py)."""
    ahead = reader.read_ahead.pop(id(g), None)
    zopt.optimizer.state.pop(g.master, None)  # first: the old state is freed before the new is read

    def read(key: str, dtype: torch.dtype, ranges: list) -> torch.Tensor:
        # zeros only where no saved element lands (padding, parameters the checkpoint lacks): zeroing
        # the whole shard first took 0.3-0.5 s of a 1.3 GB rank file's load on the benchmark machine
        t = torch.empty(g.shard_numel, dtype=dtype, device=g.master.device)
        for fqn, lo, hi, where in ranges:
            reader.fill(t[where], fqn, lo, hi, lambda grp: grp.state_tensor(key))
        _zero_outside(t, [(where.start, where.stop) for *_, where in ranges])
        return t

    state = ahead if ahead is not None else _flat_state(reader.meta, g, names, alias, read)
    if state is not None:
        zopt.optimizer.state[g.master] = state


def _flat_state(meta: Metadata, g, names, alias, tensor_for: Callable) -> dict[str, Any] | None:
    """A flat group's optimizer state from the saved groups of its slots (None: the checkpoint has
    none for it). ``tensor_for(key, dtype, ranges)`` makes the shard-sized state tensor ``key`` from
    ``ranges``: (checkpoint fqn, lo, hi, where) of each slot the checkpoint has."""
    sources = _flat_state_sources(meta, g, names, alias)
    if not sources:
        return None
    first = meta.groups[meta.params[sources[0][1]].group]
    if not first.state_tensors and not first.state_scalars:
        return None  # saved before the first step
    ranges = []
    for s, lo, hi, where in g.slot_ranges_in_shard():
        fqn = _fqn_in_checkpoint(alias, names[id(s.param)])
        if fqn is not None:
            ranges.append((fqn, lo, hi, where))
    state: dict[str, Any] = {key: tensor_for(key, dtype_from_name(dname), ranges)
                             for key, dname in first.state_tensors.items()}
    device = g.master.device
    for key, sc in first.state_scalars.items():
        if sc["tensor"]:
            state[key] = torch.tensor(sc["value"], dtype=dtype_from_name(sc["dtype"]),
                                      device=device if sc["on_param_device"] else "cpu").reshape(sc["shape"])
        else:
            state[key] = sc["value"]
    return state


class _ReadAhead:
    """The plan of a one-pass load: which optimizer-state tensors are read while their files are
    hashed. See [Note: one pass over the optimizer state] in _one_pass.py.

    Only flat groups in host memory whose optimizer holds no state for them yet (a resume) read
    ahead: their state tensors would be allocated by the commit anyway, so the load's peak memory
    is what it was. Where the optimizer has state (going back to an earlier checkpoint in the same
    process), reading ahead would hold the old state and the new one at once until the commit,
    so that state is read at the commit, from the page cache, as before.
    """

    def __init__(self, reader: _Reader, engine, zopts: list, names):
        self.reader, self.engine, self.zopts, self.names = reader, engine, zopts, names
        #: (tensor, filled ranges) to zero outside once read: an aligned read may write its edges
        self._zero: list[tuple[torch.Tensor, list[tuple[int, int]]]] = []

    @staticmethod
    def applies(g, zopts: list) -> bool:
        return (bool(zopts) and g.trainable and not g.owned and not g.master_streams and g.swap is None
                and g.master is not None and g.master.device.type == "cpu"
                and not zopts[g.optimizer_index].optimizer.state.get(g.master))

    def __call__(self, streams: dict[str, StreamReader]) -> dict[str, list[Run]]:
        """The runs of each rank file; the state tensors they fill go to ``reader.read_ahead``."""
        meta, runs = self.reader.meta, {}
        alias = meta.alias_map()
        for g in self.engine.groups:
            if self.applies(g, self.zopts):
                state = _flat_state(meta, g, self.names, alias,
                                    lambda key, dtype, ranges, g=g: self._place(g, key, dtype, ranges, streams, runs))
                if state is not None:
                    self.reader.read_ahead[id(g)] = state
        return runs

    def _place(self, g, key: str, dtype: torch.dtype, ranges: list, streams, runs: dict) -> torch.Tensor:
        """A fresh state tensor, and the runs that will fill it. Where one contiguous run of one file
        fills it, it is allocated at that run's alignment, for an ``O_DIRECT`` read in place."""
        meta = self.reader.meta
        size = torch.empty((), dtype=dtype).element_size()
        pieces = []  # (file, byte offset in it, first element in the tensor, elements)
        for fqn, lo, hi, where in ranges:
            tensor = meta.groups[meta.params[fqn].group].state_tensor(key)
            for rank, a, b, at in meta.pieces(fqn, lo, hi):
                name = meta.rank_file(rank)
                if name not in streams:  # _files_to_read missed it: a bug, never a file read unverified
                    raise CheckpointError(f"internal error: {name} is read but was not verified first")
                pieces.append((name, streams[name].byte_offset(tensor, a), where.start + at, b - a))
        one = bool(pieces) and all(p[0] == q[0] and q[1] == p[1] + p[3] * size and q[2] == p[2] + p[3]
                                   for p, q in zip(pieces, pieces[1:]))
        t = aligned_like(g.shard_numel, dtype, pieces[0][1], pieces[0][2]) if one else \
            torch.empty(g.shard_numel, dtype=dtype)
        flat = t.view(torch.uint8)
        for name, offset, at, count in pieces:
            runs.setdefault(name, []).append(Run(offset, flat[at * size:(at + count) * size], slack=one))
        self._zero.append((t, [(where.start, where.stop) for *_, where in ranges]))
        return t

    def finish(self) -> None:
        """Zero what no saved element fills (padding, parameters the checkpoint lacks), after the reads."""
        for t, filled in self._zero:
            _zero_outside(t, filled)
        self._zero.clear()


def _zero_outside(t: torch.Tensor, filled: list[tuple[int, int]]) -> None:
    """Zero the elements of the 1-D ``t`` outside the ``[start, stop)`` ranges in ``filled``."""
    at = 0
    for start, stop in sorted(filled):
        if start > at:
            t[at:start].zero_()
        at = max(at, stop)
    if at < t.numel():
        t[at:].zero_()


def _layout_changed(fqn: str, saved: str, here: str) -> CheckpointError:
    return CheckpointError(
        f"{fqn}: its optimizer state was saved for {saved} but is kept here as {here}: the optimizer or "
        "ZeroConfig(optimizer_layout=...) changed since the save. Resume with the optimizer it was saved with, "
        "or load the weights alone (optimizer=None) and start the optimizer fresh")


def _param_state_sources(meta: Metadata, g, zopt, names, alias) -> list:
    """Ownership layout: (view, saved group, saved entry or None) per parameter this rank owns that
    the checkpoint has; refuses saved state that cannot become its state."""
    out = []
    for s, _, view in zopt.owned_views(g):
        fqn = _fqn_in_checkpoint(alias, names[id(s.param)])
        if fqn is None:
            continue
        grp = meta.groups[meta.params[fqn].group]
        if not grp.trainable:
            raise _frozen_in_checkpoint(s.fqn)
        if grp.state_tensors or grp.state_scalars:
            raise _layout_changed(s.fqn, "flat shards", "whole parameters (the ownership layout)")
        out.append((view, grp, grp.param_state.get(fqn)))  # None: saved before its first step
    return out


def _load_param_state(reader: _Reader, g, zopt, names, alias) -> None:
    """Ownership layout: each parameter this rank owns now takes its whole saved state, from the rank
    file of whichever rank owned it then (See [Note: the on-disk layout] in _layout.py)."""
    for _, _, view in zopt.owned_views(g):
        zopt.optimizer.state.pop(view, None)
    for view, grp, entry in _param_state_sources(reader.meta, g, zopt, names, alias):
        if entry is None:
            continue
        state: dict[str, Any] = {}
        for key, t in entry["tensors"].items():
            value = reader.tensor(entry["rank"], grp.param_state_tensor(entry["slot"], key))
            state[key] = value.to(view.device if t["on_param_device"] else "cpu").reshape(t["shape"])
        for key, sc in entry["scalars"].items():
            state[key] = sc["value"]
        zopt.optimizer.state[view] = state


def _check_buffer_shapes(reader: _Reader, model, buffers: list[str]) -> None:
    """Each buffer to load has the model's shape (from the verified header: nothing read yet)."""
    sd = local_state_dict(model, _engine_of(model))
    for key in buffers:
        saved = tuple(reader.buffer_header[key][1])
        if saved != tuple(sd[key].shape):
            raise CheckpointError(f"buffer {key}: checkpoint shape {saved}, model {tuple(sd[key].shape)}")


def _load_buffers(reader: _Reader, model, buffers: list[str]) -> None:
    """The buffers of ``buffers`` (the model's that the checkpoint has; shapes checked before)."""
    if not buffers:
        return
    sd = local_state_dict(model, _engine_of(model))
    f = reader.handle(BUFFERS_FILE)
    for key in buffers:
        sd[key].data.copy_(f.get_tensor(key))


def _extra_state(reader: _Reader, meta: Metadata) -> Any:
    extra = meta.extra_state
    if extra is None:
        return None
    if extra["kind"] == "json":
        return extra["value"]
    rec = meta.file(extra["file"])
    path = reader.dir / rec.name
    verify_file(path, rec.digest, rec.bytes)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - pickle refusals come in several types
        raise CheckpointError(
            f"{path}: torch.load(weights_only=True) refused the saved extra_state ({err}); allow its types "
            "with torch.serialization.add_safe_globals([...]) before loading") from None


# ------------------------------------------------------------ after reading
def _publish(engine, streamed: bool = False) -> None:
    """Compute-dtype parameters from the loaded shards, as after an optimizer step. ``streamed``:
    the streamed groups' shards were written chunk by chunk as they loaded (See [Note: a streamed
    resume]): only their all-gather is left."""
    handles = []
    for g in engine.groups:
        if streamed and g.master_streams:
            handles.append(g.publish_shard(engine.comm))
            continue
        with g.resident(write_back=True):  # NVMe: master in, updated parameter shard out
            handles.append(g.publish_master(engine.comm))
    for h in handles:
        if h is not None:
            h.wait()


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _hyperparameter_updates(saved_optimizer: dict, zopt, where: Path, index: int,
                            skip: frozenset = frozenset()) -> list:
    """(param group, key, value) to restore: only fields the running optimizer has, with their types.

    Checked before anything is loaded, so a bad value refuses the whole load on every rank. A saved
    field the optimizer does not have is skipped with a warning; ``params`` is never restored.
    """
    updates, unknown = [], set()
    for j, (pg, saved) in enumerate(zip(zopt.optimizer.param_groups, saved_optimizer["param_groups"])):
        for key, value in saved.items():
            if key in skip:
                continue
            if key == "params" or key not in pg:
                unknown.add(key)
                continue
            current, at = pg[key], f"optimizers[{index}].param_groups[{j}].{key}"
            if isinstance(current, torch.Tensor):
                ok = _number(value) or isinstance(value, bool) and current.dtype == torch.bool
            elif isinstance(current, bool):
                ok = isinstance(value, bool)
            elif _number(current):
                ok = _number(value)
            elif isinstance(current, (tuple, list)):
                ok = (isinstance(value, list) and len(value) == len(current)
                      and all(_number(v) == _number(c) for v, c in zip(value, current)))
                value = tuple(value) if isinstance(current, tuple) and ok else value
            elif current is None:
                ok = value is None or isinstance(value, bool)
            else:
                ok = type(value) is type(current)
            if not ok:
                raise CheckpointError(f"{where}: {at}: saved value {value!r} does not fit "
                                      f"the optimizer's {current!r} (a finite value of the same type is needed)")
            updates.append((pg, key, value))
    if unknown:
        warnings.warn(f"{where.parent}: optimizer fields {sorted(unknown)} are not fields of the running "
                      f"{type(zopt.optimizer).__name__}; not restored", stacklevel=4)
    return updates


def _apply_hyperparameters(updates: list) -> None:
    for pg, key, value in updates:
        if isinstance(pg[key], torch.Tensor):
            pg[key].fill_(value)
        else:
            pg[key] = value


def load_metadata(path: str | Path) -> dict:
    """The metadata of a checkpoint as a plain dict (for tools and inspection), validated first."""
    join_saves_to(str(Path(path).absolute()))  # a save of this process to it, still writing, first
    ckpt_dir = resolve_checkpoint_dir(path)
    read_metadata(ckpt_dir)
    return json.loads((ckpt_dir / "metadata.json").read_text())


def _step_tensor(optimizer, master: torch.Tensor, step: float) -> torch.Tensor:
    """``step`` as torch's Adam keeps it: a scalar on the parameter's device when fused or capturable,
    else on the CPU (what ``Optimizer.load_state_dict`` makes of a saved step)."""
    pg = next(pg for pg in optimizer.param_groups if any(p is master for p in pg["params"]))
    on_device = bool(pg.get("fused")) or bool(pg.get("capturable"))
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(step, dtype=dtype, device=master.device if on_device else "cpu")
