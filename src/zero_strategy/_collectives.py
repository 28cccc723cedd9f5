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

[Note: bounded waits]
At stage 3 every forward, ``state_dict()`` and ``gathered_parameters`` all-gathers, so
a call made on some ranks only (``if rank == 0: model.generate(...)``, a rank-0-only
``save_pretrained``) leaves the ranks that made it waiting for the process group's
timeout: 30 minutes by default, with no word of why. ``Collectives(wait_timeout=s)``
bounds every wait on a gather or reduce-scatter handle: ``work.wait(timeout)`` raises
after ``s`` seconds (gloo abandons the operation; the group should not be used
again), and :class:`CollectiveTimeout` goes up to the layer that knows what the
collective was for. To say *which* ranks did not come, each rank counts the calls
that make it gather (:class:`EntryLedger`) in the c10d store the process group was
rendezvoused through: the store answers without the other ranks' help, so a rank
stuck in a collective can read how far the others got. A rank whose count is below
ours never began the call we are stuck in. Counting costs one store round trip per
call (not per collective), only at stage 3 with more than one rank.
"""

from __future__ import annotations

import datetime
import uuid
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


class CollectiveTimeout(RuntimeError):
    """A collective this rank waited on did not complete within the engine's bound.

    Raised by :meth:`Handle.wait`; the layer that knows what the collective was for
    (units, the engine) catches it and raises an error that names the unit and the
    ranks that did not come (see [Note: bounded waits]).
    """


class Handle:
    """An in-flight collective. ``wait()`` is idempotent and keeps tensors alive until then."""

    __slots__ = ("_work", "_keep", "_timeout")

    def __init__(self, work=None, keep: tuple = (), timeout: datetime.timedelta | None = None):
        self._work = work
        self._keep = keep
        self._timeout = timeout

    def wait(self) -> None:
        """Wait for the collective; past the bound it was started with, raise
        :class:`CollectiveTimeout` (see [Note: bounded waits])."""
        if self._work is not None:
            if self._timeout is None:
                self._work.wait()
            else:
                try:
                    self._work.wait(self._timeout)
                except RuntimeError as e:
                    if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
                        raise
                    self._work = None  # gloo abandons a timed-out operation; never wait on it again
                    self._keep = ()
                    raise CollectiveTimeout(str(e)) from e
            self._work = None
        self._keep = ()


class EntryLedger:
    """How many gathering calls (forwards, ``state_dict`` calls, ...) each rank of a group has
    begun, kept in the c10d store; see [Note: bounded waits]."""

    def __init__(self, group_ranks: tuple[int, ...], rank: int, namespace: str):
        """``namespace``: the same on every rank of the group, and new for every engine."""
        self.rank = rank
        self.world_size = len(group_ranks)
        self.count = 0
        self.last_kind = ""
        self._prefix = f"zero_strategy/entries/{'-'.join(map(str, group_ranks))}/{namespace}/"
        self._store = _default_store()

    def enter(self, kind: str) -> None:
        """This rank begins a call that gathers (``kind``: "forward", "state_dict", ...)."""
        self.count += 1
        self.last_kind = kind
        if self._store is not None:
            try:
                self._store.add(self._prefix + str(self.rank), 1)
            except Exception:  # noqa: BLE001 - its host (rank 0) is gone; the collective will say so
                self._store = None

    def counts(self) -> list[int] | None:
        """Every rank's count now (``add(key, 0)`` reads without waiting); None without a store."""
        if self._store is None:
            return None
        try:
            return [int(self._store.add(self._prefix + str(r), 0)) for r in range(self.world_size)]
        except Exception:  # noqa: BLE001 - the store's host may be the rank that died
            return None

    def describe(self) -> str:
        """Which ranks did not begin the call this rank is in, for an error message."""
        counts = self.counts()
        here = f"this rank (group rank {self.rank}) is in its call #{self.count} ({self.last_kind or 'gather'})"
        if counts is None:
            return here + "; how far the other ranks got is unknown (no c10d store)"
        behind = [r for r, c in enumerate(counts) if c < self.count]
        ahead = [r for r, c in enumerate(counts) if c > self.count]
        parts = [here]
        if behind:
            parts.append("group ranks " + ", ".join(f"{r} (at call #{counts[r]})" for r in behind)
                         + " never began it")
        if ahead:
            parts.append("group ranks " + ", ".join(f"{r} (at call #{counts[r]})" for r in ahead)
                         + " are already past it")
        if not behind and not ahead:
            parts.append("every rank began it, so a rank is stuck or slow inside it")
        return "; ".join(parts)


def _default_store():
    """The store the default process group rendezvoused through (None if unavailable)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private accessor: degrade to messages without rank names
        return None


class Collectives:
    """Collectives over one process group, with byte counters.

    ``small_tensor_ops`` (scalars for overflow checks and norms) go through
    ``all_reduce``; they are counted too so the volume test sees everything.
    ``wait_timeout``: seconds a wait on a gather or reduce-scatter may take before
    :class:`CollectiveTimeout` (None: the process group's own timeout).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, wait_timeout: float | None = None):
        if dist.is_available() and dist.is_initialized():
            _check_member(group)
            self.group = group
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend = str(dist.get_backend(group))
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                range(dist.get_world_size()))
        else:
            if group is not None:
                raise ValueError("a process_group was given but torch.distributed is not initialized")
            self.group, self.rank, self.world_size, self.backend = None, 0, 1, "none"
            ranks = (0,)
        self.wait_timeout = wait_timeout
        #: the bound every async handle waits with, converted once (handles are made per collective)
        self._handle_timeout = None if wait_timeout is None else datetime.timedelta(seconds=wait_timeout)
        self.stats = CommStats()
        self.ledger = None
        if self.world_size > 1:  # group rank 0's fresh token names this engine's counters everywhere
            namespace = self.broadcast_object(uuid.uuid4().hex if self.rank == 0 else None)
            self.ledger = EntryLedger(ranks, self.rank, namespace)

    def enter(self, kind: str) -> None:
        """A call that gathers begins on this rank (counted for error messages; see the Note)."""
        if self.ledger is not None:
            self.ledger.enter(kind)

    def who_is_missing(self) -> str:
        return self.ledger.describe() if self.ledger is not None else "single rank"

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
        return Handle(work, (output, shard), self._handle_timeout) if async_op else Handle()

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
        return Handle(work, (shard, full), self._handle_timeout) if async_op else Handle()

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
