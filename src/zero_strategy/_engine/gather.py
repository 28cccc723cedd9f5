"""Whole parameters outside forward: gathered for a block, changed on every rank, or copied out.

The engine gathers a unit for its forward and backward and releases it after; these
are the other times a caller needs whole tensors at stage 3: ``gathered_parameters``
(read, or change on one rank and broadcast), ``modified_on_every_rank`` (a change
every rank makes identically, such as a PEFT merge) and ``full_state_dict`` (the
fp32 weights, group by group to the host). They take the engine, not the model, so
both the public API (api.py) and the model integrations (integrations.py) use them.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterable, Iterator

import torch
from torch import nn

from .._mechanisms import nvme_stream
from .._mechanisms.host_memory import release_if_large
from .flat import ShardState
from .offload_states import refuse_while_offloaded

if TYPE_CHECKING:
    from .engine import ZeroEngine


@torch.no_grad()
def full_state_dict(engine: "ZeroEngine", rank0_only: bool = False,
                    dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """``zero_strategy.full_state_dict`` for this engine (what it returns: see there).

    Group by group: each gathered group goes to the host before the next is gathered, so
    the device holds one group beyond its shards. The gathered buffer is counted in the
    working set ("gathered") while it lives, as a unit gathered for forward is, so
    ``memory_report`` shows what a consolidation costs. With ``rank0_only`` the other
    ranks take part in each all-gather and drop its result at once.
    """
    refuse_while_offloaded(engine, "zero_strategy.full_state_dict()", ("lp_params", "hp_params"))
    comm = engine.comm
    comm.enter("full_state_dict")  # See [Note: naming the rank that failed] in _comm/faults.py
    keep = not (rank0_only and comm.rank != 0)
    values: dict[int, torch.Tensor] = {}
    for g in engine.groups:
        values.update(group_values(engine, g, keep, dtype))
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for name, t in engine.model.state_dict(keep_vars=True).items():
        if id(t) in values:
            out[name] = values[id(t)]
        else:
            out[name] = _to_host(t.detach(), dtype if t.is_floating_point() else None)
    return out


@torch.no_grad()
def group_values(engine: "ZeroEngine", g, keep: bool, dtype: torch.dtype | None) -> dict[int, torch.Tensor]:
    """id(param) -> a host copy of each whole parameter of group ``g`` (in ``dtype``; None:
    the stored one), from the fp32 master where the group trains. ``keep=False``: take part in
    the all-gather (every rank must) and return ``{}``.

    The gathered buffer is counted in the working set ("gathered") while it lives, as a unit
    gathered for forward is (See [Note: the working set]), and freed before this returns, so
    a caller going group by group holds one group beyond its shards on the device.
    """
    comm = engine.comm
    counted = 0
    try:
        with _weight_source(g) as source:
            if g.master is None and not g.shard_params:
                full = g.full  # whole at rest: nothing to gather
            else:
                if source.device != engine.device and comm.backend == "nccl":
                    source = source.to(engine.device)  # offloaded: NCCL gathers device tensors
                full = torch.empty(g.padded_numel, dtype=source.dtype, device=source.device)
                counted = full.untyped_storage().nbytes()
                engine.transfers.working_set.add("gathered", counted)
                comm.all_gather(full, source, async_op=False, label=g.name)
        if not keep:
            return {}
        return {id(s.param): _to_host(full[s.offset:s.offset + s.numel].view(s.shape), dtype) for s in g.slots}
    finally:
        full = None  # freed here, before the next group is gathered
        engine.transfers.working_set.remove("gathered", counted)
        # and what the gather and the copies freed, before the next group allocates on top of it
        release_if_large(engine.config.release_host_memory, 4 * g.padded_numel)  # See [Note: freed host memory]


@contextlib.contextmanager
def _weight_source(g) -> Iterator[torch.Tensor]:
    """Group ``g``'s weight shard (``weight_shard``) for a gather inside the block. A group whose
    master and optimizer state stream from NVMe (larger than a staging slot) gives its master
    alone, read piece by piece into one shard-sized tensor, rather than master, moments and
    parameter shard brought in whole: a third of the bytes."""
    if g.trainable and not g.owned and g.masters.streams:
        g.swap.wait_writes()  # the last step's write-backs: the pieces are read from the file
        out = torch.empty(g.shard_numel, dtype=g.master.dtype)
        nvme_stream.read_into(g.swap, g, "opt", "master", out)
        yield out
        return
    with g.resident(write_back=False):
        yield g.weight_shard


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
    refuse_while_offloaded(engine, kind, ("lp_params", "hp_params") if kind == "modify" else ("lp_params",))
    groups = engine.groups if params is None else _groups_holding(engine, params)
    units = {id(engine.unit_of(g)): engine.unit_of(g) for g in groups}.values()
    was_sharded = {id(u): u.state is ShardState.SHARDED for u in units}
    if any(u.sharded_groups for u in units):
        engine.comm.enter(kind)  # see [Note: bounded waits] in _comm/waits.py
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
