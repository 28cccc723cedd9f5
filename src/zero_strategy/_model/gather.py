"""Whole parameters outside forward: gathered for a block, changed on every rank, or copied out.

The engine gathers a unit for its forward and backward and releases it after; these
are the other times a caller needs whole tensors at stage 3: ``gathered_parameters``
(read, or change on one rank and broadcast), ``modified_on_every_rank`` (a change
every rank makes identically, such as a PEFT merge) and ``full_state_dict`` (the
fp32 weights, group by group to the host), and the same unit by unit for the streamed
saves (:func:`unit_values`). They take the engine, not the model, so both the public API
(api.py) and the library shadows (_model/hf.py) use them. :func:`whole_model_pass` is what
the engine gives back around any such pass over the whole model.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from torch import nn

from .._mechanisms import nvme_stream
from .._mechanisms.memory import release_if_large
from .._engine.engine import refuse_while_offloaded
from .._engine.flat import ShardState

if TYPE_CHECKING:
    from .._engine.engine import ZeroEngine
    from .._engine.units import Unit


@torch.no_grad()
def full_state_dict(engine: "ZeroEngine", rank0_only: bool = False,
                    dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """``zero_strategy.full_state_dict`` for this engine (what it returns: see there).

    Group by group: each gathered group goes to the host before the next is gathered, so
    the device holds one group beyond its shards. The gathered buffer is counted in the
    working set ("gathered") while it lives, as a unit gathered for forward is, so
    ``memory_report`` shows what a consolidation costs. With ``rank0_only`` the other
    ranks send their shards to rank 0 and hold nothing more.
    """
    refuse_while_offloaded(engine.offloaded, "zero_strategy.full_state_dict()", ("lp_params", "hp_params"))
    comm = engine.comm
    comm.enter("full_state_dict")  # See [Note: naming the rank that failed] in _comm/faults.py
    keep = not (rank0_only and comm.rank != 0)
    values: dict[int, torch.Tensor] = {}
    for g in engine.groups:
        values.update(group_values(engine, g, keep, dtype, to=0 if rank0_only else None))
    ep = engine.expert_parallel  # every rank gathers the experts: See [Note: expert parallelism] in _model/expert_parallel.py
    if ep is not None:
        values.update(ep.full_values(dtype, to=0 if rank0_only else None))
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    with ep.local_state() if ep is not None else contextlib.nullcontext():
        named = engine.model.state_dict(keep_vars=True)
    for name, t in named.items():
        if id(t) in values:
            out[name] = values[id(t)]
        else:
            out[name] = _to_host(t.detach(), dtype if t.is_floating_point() else None)
    return out


@torch.no_grad()
def group_values(engine: "ZeroEngine", g, keep: bool, dtype: torch.dtype | None,
                 to: int | None = None) -> dict[int, torch.Tensor]:
    """id(param) -> a host copy of each whole parameter of group ``g`` (in ``dtype``; None:
    the stored one), from the fp32 master where the group trains. ``keep=False``: take part in
    the gather (every rank must) and return ``{}``. ``to``: the one group rank that may keep,
    which alone receives the whole group (the others send their shards and hold nothing more:
    See [Note: gloo's all-gather holds its output twice] in _comm/gloo_gathers.py); None: every
    rank receives it.

    The gathered buffer is counted in the working set ("gathered") while it lives, as a unit
    gathered for forward is (See [Note: the working set]), and freed before this returns, so
    a caller going group by group holds one group beyond its shards on the device.
    """
    comm = engine.comm
    assert to is None or keep <= (comm.rank == to), "only the rank a gather goes to can keep it"
    if g.opaque:  # bit patterns, not numbers: never cast (See [Note: opaque groups] in _engine/flat.py)
        dtype = None
    if to is not None and comm.backend == "gloo" and (g.master is not None or g.shard_params):
        return _values_at_one_rank(engine, g, keep, dtype, to)
    counted = 0
    try:
        with _weight_source(g) as source:
            if g.master is None and not g.shard_params:
                full = g.full  # whole at rest: nothing to gather
            else:
                if source.device != engine.device and comm.backend == "nccl":
                    source = source.to(engine.device)  # offloaded: NCCL gathers device tensors
                full = None
                if to is None or comm.rank == to:
                    full = torch.empty(g.padded_numel, dtype=source.dtype, device=source.device)
                    counted = full.untyped_storage().nbytes()
                    engine.transfers.working_set.add("gathered", counted)
                if to is None:
                    comm.all_gather(full, source, async_op=False, label=g.name)
                else:
                    comm.gather_to(full, source, to, label=g.name)
        if not keep:
            return {}
        return {id(s.param): _to_host(full[s.offset:s.offset + s.numel].view(s.shape), dtype) for s in g.slots}
    finally:
        full = None  # freed here, before the next group is gathered
        engine.transfers.working_set.remove("gathered", counted)
        # and what the gather and the copies freed, before the next group allocates on top of it
        release_if_large(engine.config.release_host_memory, 4 * g.padded_numel)  # See [Note: releases where a phase ends]


def _values_at_one_rank(engine: "ZeroEngine", g, keep: bool, dtype: torch.dtype | None,
                        to: int) -> dict[int, torch.Tensor]:
    """:func:`group_values` for a gather only group rank ``to`` receives, on gloo: the pieces of
    each rank's shard go straight into the parameters' host copies there (point to point), and
    ``to`` reads its own shard piece by piece into them, so no rank holds the gathered group:
    ``to`` holds what it returns and a staging slot, the others their shard (in ``dtype``).
    See [Note: gloo's all-gather holds its output twice] in _comm/gloo_gathers.py."""
    comm = engine.comm
    stored = g.master.dtype if g.master is not None else g.param_shard.dtype
    out_dtype = dtype if dtype is not None and stored.is_floating_point else stored
    if comm.rank != to:
        with _weight_source(g) as source:
            source = source.to(out_dtype)
            sends = [source[where] for _, _, _, where in g.slot_ranges_in_shard()]
            comm.pieces_to(sends, None, to, g.padded_numel, label=g.name).wait()
        release_if_large(engine.config.release_host_memory, 4 * g.shard_numel)  # See [Note: releases where a phase ends]
        return {}
    flat = [torch.empty(s.numel, dtype=out_dtype, device="cpu") for s in g.slots]
    receives = {k: [flat[s.index][lo:hi] for s, lo, hi, _ in g.slot_ranges_in_shard(k)]
                for k in range(comm.world_size) if k != to}
    counted = sum(t.numel() * t.element_size() for t in flat)
    engine.transfers.working_set.add("gathered", counted)
    try:
        handle = comm.pieces_to([], receives, to, g.padded_numel, label=g.name)
        mine = list(g.slot_ranges_in_shard())
        for at, piece in _weight_pieces(g):  # this rank's own shard, into the copies
            for s, lo, _, where in mine:
                a, b = max(where.start, at), min(where.stop, at + piece.numel())
                if a < b:
                    flat[s.index][lo + a - where.start:lo + b - where.start].copy_(piece[a - at:b - at])
        handle.wait()
    finally:
        engine.transfers.working_set.remove("gathered", counted)
    if not keep:
        return {}
    return {id(s.param): flat[s.index].view(s.shape) for s in g.slots}


def _weight_pieces(g) -> Iterator[tuple[int, torch.Tensor]]:
    """Group ``g``'s weight shard (``weight_shard``) as (start, piece) pairs: where its master streams
    from NVMe (larger than a staging slot), its master alone, piece by piece through a slot (each
    piece valid until the next is asked for), rather than master, moments and parameter shard
    brought in whole: a third of the bytes, never the whole shard. Else the shard, whole."""
    if g.master_streams:
        g.swap.wait_writes()  # the last step's write-backs: the pieces are read from the file
        at = 0
        for piece in nvme_stream.pieces(g.swap, g, "opt", "master"):
            yield at, piece
            at += piece.numel()
        return
    with g.resident(write_back=False):
        yield 0, g.weight_shard


@contextlib.contextmanager
def _weight_source(g) -> Iterator[torch.Tensor]:
    """Group ``g``'s weight shard, whole, for a gather inside the block: the shard itself, or where
    the master streams, its :func:`_weight_pieces` copied into one shard-sized tensor."""
    if not g.master_streams:
        with g.resident(write_back=False):
            yield g.weight_shard
        return
    out = torch.empty(g.shard_numel, dtype=g.master.dtype)
    for at, piece in _weight_pieces(g):
        out[at:at + piece.numel()].copy_(piece)
    yield out


def _to_host(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A copy of ``t`` in host memory (in ``dtype``), cast and moved in one copy."""
    return torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu").copy_(t)


@contextlib.contextmanager
def gathered_parameters(engine: "ZeroEngine", params: Iterable[nn.Parameter] | None = None,
                        modifier_rank: int | None = None) -> Iterator[None]:
    """Materialize full parameters inside the block (stage 3), then re-shard.

    ``params``: only the groups holding these (default: all). ``modifier_rank``: if
    given, changes that rank makes to the gathered parameters are broadcast to all
    ranks and written into the fp32 masters on exit; otherwise changes are discarded
    (stage 3) and must not be made. Every rank must enter the context.
    """
    with gathered(engine, params, "gathered_parameters") as groups:
        try:
            yield
        finally:
            if modifier_rank is not None:
                with torch.no_grad():
                    for g in groups:
                        g.adopt_replaced_data()
                        engine.comm.broadcast(g.full, src_rank=modifier_rank, label=g.name)
                        g.write_back_gathered()


def gathered_units(engine: "ZeroEngine", named: Iterable[tuple[str, nn.Parameter]]
                   ) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """``named`` (name, parameter) pairs one unit at a time: each unit's pairs, in the order they
    first appear, yielded while that unit is gathered (:func:`gathered_parameters`), then the
    pairs the engine does not hold (non-floating: always whole) as one last list. Every rank must
    iterate to the end (each unit is an all-gather)."""
    by_unit: dict[int, list[tuple[str, nn.Parameter]]] = {}
    loose: list[tuple[str, nn.Parameter]] = []
    for name, p in named:
        group = engine.group_of(p)
        if group is None:
            loose.append((name, p))
        else:
            by_unit.setdefault(id(engine.unit_of(group)), []).append((name, p))
    for members in by_unit.values():
        with gathered_parameters(engine, [p for _, p in members]):
            yield members
    if loose:
        yield loose


@contextlib.contextmanager
def modified_on_every_rank(engine: "ZeroEngine", params: Iterable[nn.Parameter] | None = None) -> Iterator[None]:
    """Like ``gathered_parameters(modifier_rank=...)`` for a change every rank makes identically
    (a deterministic merge of adapters): each rank writes its own slice back, nothing is broadcast.

    Front ends use it around library calls that rewrite weights in place (PEFT's merges).
    """
    with gathered(engine, params, "modify") as groups:
        yield
        with torch.no_grad():
            for g in groups:
                g.adopt_replaced_data()
                g.write_back_gathered()


@contextlib.contextmanager
def gathered(engine: "ZeroEngine", params: Iterable[nn.Parameter] | None, kind: str):
    """Gather the units holding ``params`` (all: None) for the block; release those that were sharded."""
    refuse_while_offloaded(engine.offloaded, kind, ("lp_params", "hp_params") if kind == "modify" else ("lp_params",))
    groups = engine.groups if params is None else _groups_holding(engine, params)
    units = {id(engine.unit_of(g)): engine.unit_of(g) for g in groups}.values()
    was_sharded = {id(u): u.state is ShardState.SHARDED for u in units}
    if any(u.sharded_groups for u in units):
        engine.comm.enter(kind)  # see [Note: bounded waits] in _comm/collectives.py
    for u in units:
        u.gather(engine.comm)
    try:
        yield groups
    finally:
        for u in units:
            if was_sharded[id(u)]:
                u.release()


def _groups_holding(engine: "ZeroEngine", params: Iterable[nn.Parameter]):
    out, seen = [], set()
    for p in params:
        g = engine.group_of(p)
        if g is None:
            raise ValueError(f"gathered_parameters: a parameter of shape {tuple(p.shape)} is not managed "
                             "by zero_strategy (not in the set-up model)")
        if id(g) not in seen:
            seen.add(id(g))
            out.append(g)
    return out


def unit_values(engine: "ZeroEngine", wanted: set[int], keep: bool,
                dtype: Callable[[object], torch.dtype | None],
                to: int | None = None) -> Iterator[tuple["Unit", dict[int, torch.Tensor]]]:
    """For each unit holding a parameter in ``wanted`` (ids), in the engine's order: the unit and
    id(param) -> host copy of those of its parameters (``{}`` where not ``keep``). The caller
    drops each dict before asking for the next; ``dtype(group)``: the dtype to copy it in;
    ``to``: the one rank that keeps (:func:`group_values`)."""
    for unit in engine.units:
        groups = [g for g in unit.groups if any(id(s.param) in wanted for s in g.slots)]
        if not groups:
            continue
        values: dict[int, torch.Tensor] = {}
        for g in groups:
            values.update((pid, t) for pid, t in group_values(engine, g, keep, dtype(g), to).items()
                          if pid in wanted)
        yield unit, values
        del values  # before the next unit is gathered (the caller drops its reference too)


def sole_keeper(comm, keep: bool) -> int | None:
    """The group rank a gather should go to when at most one rank keeps what it gathers (a save
    that one rank writes; the rank of the lowest number where none does), so the others hold
    nothing beyond their shards; None when several keep. One small collective."""
    if comm.world_size == 1:
        return None
    keepers = [r for r, k in enumerate(comm.all_gather_object(bool(keep), label="keepers")) if k]
    return keepers[0] if len(keepers) == 1 else (0 if not keepers else None)


@contextlib.contextmanager
def whole_model_pass(engine: "ZeroEngine") -> Iterator[None]:
    """Around a pass over the whole model outside training (a save, a load, a full state dict):
    freed host memory released and the engine's idle buffers dropped, before the block and after
    it (``release_host_memory=False``: neither). See [Note: releases where a phase ends] and
    [Note: staging between passes] in _mechanisms/memory.py."""
    with engine.host_releases.around_pass():
        yield
