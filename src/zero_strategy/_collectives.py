"""Collectives on flat buffers: all-gather, reduce-scatter, all-reduce.

This is the only module that calls ``torch.distributed`` collectives. It knows
nothing about modules, hooks or parameters: it moves 1-D tensors and counts the
bytes. A world of one rank takes the same calls and skips the communication, so
every stage runs (and is tested) in a single process.

[Note: which reduce-scatter]
On gloo the list form of ``reduce_scatter`` measured ~1.5x faster than the
single-tensor form for 64 MiB buffers (../shared/ANCHORS.md), so gloo gets the list
form and everything else (NCCL) the single-tensor form. Both need equal shards,
which the flat buffers guarantee by padding.

[Note: streams]
Async collectives (``async_op=True``) run on the backend's own stream (NCCL keeps an
internal stream per device; gloo uses its own threads), so they overlap with the
compute stream without one of ours. ``Handle.wait()`` makes the *current* stream
wait for the collective, and the engine keeps every input and output alive until
that wait (``Handle`` holds them) and frees or reads them only after it. Anything
the engine writes into a buffer before launching a collective on it is ordered
before the launch on the same stream.

[Note: what the byte counters count]
``volume_elements`` counts the full (unsharded) buffer of every collective, the
convention of the ZeRO paper in which DDP's all-reduce moves 2x the parameters and
stage 3 moves 3x. ``sent_bytes`` is what a bandwidth-optimal (ring) algorithm
actually sends from each rank: (N-1)/N of the volume for all-gather and
reduce-scatter, 2(N-1)/N for all-reduce.

[Note: group ranks]
``process_group`` may be a subgroup (``dist.new_group([2, 3])``,
``dist.new_subgroups()``): each subgroup shards and trains on its own, like
``DDP(model, process_group=sub)``. Everything here speaks *group* ranks
(``self.rank``, ``src_rank``), and the one torch call that wants a *global* rank,
the ``src`` of a broadcast, is translated in :meth:`Collectives.global_rank`; every
call passes ``group=self.group``. A rank outside the group it passes gets a
``ValueError`` at construction, before any communication, so the members are not
left waiting in a collective (tests/test_subgroup_process_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class OpCounter:
    calls: int = 0
    volume_elements: int = 0
    volume_bytes: int = 0
    sent_bytes: int = 0


@dataclass
class CommStats:
    """Per-kind counters of what this rank communicated since the last reset."""

    all_gather: OpCounter = field(default_factory=OpCounter)
    reduce_scatter: OpCounter = field(default_factory=OpCounter)
    all_reduce: OpCounter = field(default_factory=OpCounter)

    def reset(self) -> None:
        self.all_gather = OpCounter()
        self.reduce_scatter = OpCounter()
        self.all_reduce = OpCounter()

    @property
    def volume_elements(self) -> int:
        return sum(c.volume_elements for c in (self.all_gather, self.reduce_scatter, self.all_reduce))

    @property
    def sent_bytes(self) -> int:
        return sum(c.sent_bytes for c in (self.all_gather, self.reduce_scatter, self.all_reduce))

    def as_dict(self) -> dict:
        out = {}
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            c = getattr(self, kind)
            out[kind] = dict(calls=c.calls, volume_elements=c.volume_elements,
                             volume_bytes=c.volume_bytes, sent_bytes=c.sent_bytes)
        out["volume_elements"] = self.volume_elements
        out["sent_bytes"] = self.sent_bytes
        return out


class Handle:
    """An in-flight collective. ``wait()`` is idempotent and keeps tensors alive until then."""

    __slots__ = ("_work", "_keep")

    def __init__(self, work=None, keep: tuple = ()):
        self._work = work
        self._keep = keep

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._keep = ()


class Collectives:
    """Collectives over one process group, with byte counters.

    ``small_tensor_ops`` (scalars for overflow checks and norms) go through
    ``all_reduce``; they are counted too so the volume test sees everything.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if dist.is_available() and dist.is_initialized():
            _check_member(group)
            self.group = group
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
        else:
            if group is not None:
                raise ValueError("a process_group was given but torch.distributed is not initialized")
            self.group, self.rank, self.world_size, self.backend = None, 0, 1, "none"
        self.stats = CommStats()

    # ------------------------------------------------------------------ helpers
    def _count(self, counter: OpCounter, t: torch.Tensor, numel: int, ring_factor: float) -> None:
        counter.calls += 1
        counter.volume_elements += numel
        counter.volume_bytes += numel * t.element_size()
        counter.sent_bytes += int(numel * t.element_size() * ring_factor)

    # --------------------------------------------------------------- collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = True) -> Handle:
        """output[N*S] <- concat over ranks of shard[S]. ``shard`` may be a view of output's own slot."""
        n = self.world_size
        assert output.numel() == shard.numel() * n, (output.numel(), shard.numel(), n)
        if n == 1:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return Handle()
        self._count(self.stats.all_gather, output, output.numel(), (n - 1) / n)
        work = _all_gather_single(output, shard, group=self.group, async_op=async_op)
        return Handle(work, (output, shard)) if async_op else Handle()

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = True) -> Handle:
        """shard[S] <- sum over ranks of this rank's slot of full[N*S] (callers pre-divide to average)."""
        n = self.world_size
        assert full.numel() == shard.numel() * n, (full.numel(), shard.numel(), n)
        if n == 1:
            shard.copy_(full)
            return Handle()
        self._count(self.stats.reduce_scatter, full, full.numel(), (n - 1) / n)
        if self.backend == "gloo":
            work = dist.reduce_scatter(shard, list(full.chunk(n)), group=self.group, async_op=async_op)
        else:
            work = _reduce_scatter_single(shard, full, group=self.group, async_op=async_op)
        return Handle(work, (shard, full)) if async_op else Handle()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Handle:
        """In-place all-reduce; ``op`` is "sum" or "max"."""
        n = self.world_size
        if n == 1:
            return Handle()
        self._count(self.stats.all_reduce, tensor, tensor.numel(), 2 * (n - 1) / n)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        work = dist.all_reduce(tensor, op=red, group=self.group, async_op=async_op)
        return Handle(work, (tensor,)) if async_op else Handle()

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank``; see [Note: group ranks]."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def broadcast(self, tensor: torch.Tensor, src_rank: int) -> None:
        """Broadcast from ``src_rank`` (rank within the group): initial weights, user edits of gathered params."""
        if self.world_size == 1:
            return
        dist.broadcast(tensor, src=self.global_rank(src_rank), group=self.group)

    # ------------------------------------------------------------- small objects
    def broadcast_object(self, obj: Any, src_rank: int = 0) -> Any:
        """Group rank ``src_rank``'s picklable ``obj`` on every rank (checkpoint decisions)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.global_rank(src_rank), group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's picklable ``obj``, in group-rank order."""
        if self.world_size == 1:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _check_member(group: dist.ProcessGroup | None) -> None:
    """Refuse a group this rank is not in (``dist.new_group(ranks)`` on a rank outside ``ranks``)."""
    if group is None:
        return
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(
            f"zero_strategy.setup: this process (global rank {dist.get_rank()}) is not a member of the "
            "process_group it passed; torch.distributed.new_group(ranks) returns a non-member placeholder "
            "on every rank outside `ranks`. Pass each rank the group that contains it (create every group "
            "on every rank and pick the one holding dist.get_rank(), or use dist.new_subgroups()), or "
            "process_group=None to shard over the whole world")
