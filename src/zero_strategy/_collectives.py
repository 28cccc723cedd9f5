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

[Note: a failed group]
A gloo group whose collective failed still has operations pending on its worker
threads (waiting for a peer that is stuck or gone), and its C++ destructor joins those
threads: the interpreter's exit would block until the group's own timeout, 30 minutes
by default, so the rank that raised stays alive and a launcher waiting for it
(torchrun, SLURM) with it. ``ProcessGroup.abort()`` does not unblock gloo, and
``destroy_process_group`` blocks in the same destructor (both measured on torch 2.13).
So after a failure one reference to the group is deliberately leaked: it is never
destructed, and the process exits at once. It stays registered, so the user's
``dist.get_rank()`` in an error handler still works; its collectives must not be used
again (NCCL's watchdog tears the whole process down on a timeout by default).

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
bounds every wait, of every collective issued here (gathers, reduce-scatters, the
loss-scale and gradient-norm all-reduces, broadcasts, and the object collectives,
which are built on tensor collectives for that reason): ``work.wait(timeout)`` raises
after ``s`` seconds (gloo abandons the operation; the group should not be used
again), and :class:`CollectiveTimeout` goes up. A peer that exits or is killed closes
its connections and ends the wait at once with :class:`CollectiveError`. Either
message names the collective (what it was for, its sequence number, the step), the
ranks that never began it or reported a failure, and the last collectives of each
rank: See [Note: naming the rank that failed] in _faults.py. Counting calls costs one
store round trip per call (a forward, a ``state_dict()``), not per collective.
"""

from __future__ import annotations

import ctypes
import datetime
import pickle
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ._faults import (CollectiveError, CollectiveTimeout, FlightRecorder, Ledger, Record, diagnosis,
                      is_timeout)

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
    #: hybrid sharding: the all-reduce of gradient shards across the shard groups
    inter_all_reduce: OpCounter = field(default_factory=OpCounter)

    KINDS = ("all_gather", "reduce_scatter", "all_reduce")

    def reset(self) -> None:
        self.all_gather = OpCounter()
        self.reduce_scatter = OpCounter()
        self.all_reduce = OpCounter()
        self.inter_all_reduce = OpCounter()

    @property
    def volume_elements(self) -> int:
        return sum(getattr(self, k).volume_elements for k in self.KINDS)

    @property
    def sent_bytes(self) -> int:
        """Bytes sent inside the shard group (the whole group when not hybrid)."""
        return sum(getattr(self, k).sent_bytes for k in self.KINDS)

    def as_dict(self) -> dict:
        out = {}
        for kind in self.KINDS + ("inter_all_reduce",):
            c = getattr(self, kind)
            out[kind] = dict(calls=c.calls, volume_elements=c.volume_elements,
                             volume_bytes=c.volume_bytes, sent_bytes=c.sent_bytes)
        out["volume_elements"] = self.volume_elements
        out["sent_bytes"] = self.sent_bytes
        out["intra_group_sent_bytes"] = self.sent_bytes
        out["inter_group_sent_bytes"] = self.inter_all_reduce.sent_bytes
        return out


class Handle:
    """An in-flight collective. ``wait()`` is idempotent and keeps tensors alive until then."""

    __slots__ = ("_work", "_keep", "_comm", "_record", "_unbounded")

    def __init__(self, work=None, keep: tuple = (), comm: "Collectives | None" = None,
                 record: Record | None = None, unbounded: bool = False):
        """``unbounded``: the work's own ``wait(timeout)`` ignores the timeout; See [Note: unbounded works]."""
        self._work = work
        self._keep = keep
        self._comm = comm
        self._record = record
        self._unbounded = unbounded

    def wait(self) -> None:
        """Wait for the collective; past the engine's bound, or when a peer is gone, raise
        :class:`CollectiveTimeout` / :class:`CollectiveError` (see [Note: bounded waits])."""
        if self._work is not None:
            work, self._work = self._work, None  # a failed operation is abandoned: never waited on again
            try:
                if self._comm is None or self._comm.handle_timeout is None:
                    work.wait()
                elif self._unbounded:
                    _wait_on_thread(work, self._comm.wait_timeout)
                else:
                    work.wait(self._comm.handle_timeout)
            except RuntimeError as e:
                self._keep = ()
                raise self._comm.failure(self._record, e) from e
            FlightRecorder.finish(self._record, ok=True)
        self._keep = ()


def _wait_on_thread(work, seconds: float) -> None:
    """``work.wait()`` on a daemon thread, given up after ``seconds``.

    [Note: unbounded works]
    gloo's reduce-scatter (both the list form and ``reduce_scatter_tensor``, torch 2.13)
    returns a wrapper work whose ``wait(timeout)`` waits on the inner operation without
    the timeout, and whose ``is_completed()`` stays False, so neither a bounded wait nor
    polling can give up on it. The wait runs on a daemon thread instead, which this rank
    waits for with a bound; a thread left blocked by a failed collective dies with the
    process (daemon threads are not joined at exit). One thread per wait costs ~0.1 ms,
    small beside a gloo reduce-scatter.
    """
    done = threading.Event()
    box: list[BaseException] = []

    def run():
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box.append(e)
        done.set()

    threading.Thread(target=run, name="zero_strategy_wait", daemon=True).start()
    if not done.wait(seconds):
        raise RuntimeError(f"Operation timed out after {seconds:g} s (reduce-scatter)")
    if box:
        raise box[0]


class Collectives:
    """Collectives over one process group, with byte counters and a flight recorder.

    ``small_tensor_ops`` (scalars for overflow checks and norms) go through
    ``all_reduce``; they are counted too so the volume test sees everything.
    ``wait_timeout``: seconds any wait may take before :class:`CollectiveTimeout`
    (None: the process group's own timeout).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, wait_timeout: float | None = None,
                 replicate_group: dist.ProcessGroup | None = None):
        """``replicate_group``: hybrid sharding, the ranks holding the same shard in the other shard
        groups (See [Note: hybrid sharding] in _hybrid.py); None: ``group`` is the whole data parallel."""
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
        self.replicate_group = replicate_group
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        #: which shard group this rank is in (0: the one that writes checkpoints)
        self.replica_index = dist.get_rank(replicate_group) if replicate_group is not None else 0
        #: every rank training the model: the gradient average divides by it
        self.data_parallel_size = self.world_size * self.replicas
        self.wait_timeout = wait_timeout
        #: the bound every handle waits with, converted once (handles are made per collective)
        self.handle_timeout = None if wait_timeout is None else datetime.timedelta(seconds=wait_timeout)
        self.stats = CommStats()
        self.recorder = FlightRecorder()
        #: set once a collective failed here: the group must not be used again (no teardown gather)
        self.failed = False
        self.ledger = None
        if self.world_size > 1:  # group rank 0's fresh token names this engine's records everywhere
            namespace = self.broadcast_object(uuid.uuid4().hex if self.rank == 0 else None, label="setup")
            self.ledger = Ledger(ranks, self.rank, namespace)

    def enter(self, kind: str) -> None:
        """A call that issues collectives begins on this rank (counted for error messages; see the Note)."""
        if self.ledger is not None:
            self.ledger.enter(kind)

    def who_is_missing(self) -> str:
        return self.ledger.describe() if self.ledger is not None else "single rank"

    def on_step(self) -> None:
        """An optimizer step finished: later records carry the next step number."""
        self.recorder.step += 1

    def failure(self, record: Record | None, error: BaseException) -> CollectiveError:
        """The error for a failed wait; publishes this rank's failure and flight recorder first."""
        FlightRecorder.finish(record, ok=False)
        self.failed = True
        if self.ledger is not None:
            self.ledger.publish_flight(self.recorder)
        message = diagnosis(self.ledger, self.recorder, record, self.rank, self.wait_timeout, error)
        self.report_failure(message.splitlines()[0])
        self._abort()
        return (CollectiveTimeout if is_timeout(error) else CollectiveError)(message)

    def _abort(self) -> None:
        """Keep the failed group from being destructed, so that this process can exit; See [Note: a
        failed group]."""
        try:
            pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))  # never destroyed: see the Note
        except Exception as e:  # noqa: BLE001 - best effort: the error message matters more
            print(f"zero_strategy: could not release the process group after a failed collective: {e!r}",
                  file=sys.stderr)

    def report_failure(self, why: str) -> None:
        """Tell the other ranks (through the store) that this rank gives up, and why."""
        self.failed = True
        if self.ledger is not None:
            self.ledger.report_failure(f"{why} (at {time.strftime('%H:%M:%S')}, step {self.recorder.step})",
                                       self.recorder)

    # ------------------------------------------------------------------ helpers
    def _count(self, counter: OpCounter, t: torch.Tensor, numel: int, ring_factor: float) -> None:
        counter.calls += 1
        counter.volume_elements += numel
        counter.volume_bytes += numel * t.element_size()
        counter.sent_bytes += int(numel * t.element_size() * ring_factor)

    def _issue(self, op: str, label: str, t: torch.Tensor, numel: int, async_op: bool, keep: tuple, call) -> Handle:
        """Record, launch asynchronously, and return a bounded handle (waited now unless ``async_op``)."""
        record = self.recorder.issue(op, label, numel, numel * t.element_size())
        try:
            work = call()
        except RuntimeError as e:  # gloo may fail at launch when a peer is already gone
            raise self.failure(record, e) from e
        handle = Handle(work, keep, self, record, unbounded=op == "reduce_scatter" and self.backend == "gloo")
        if not async_op:
            handle.wait()
        return handle

    # --------------------------------------------------------------- collectives
    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = True,
                   label: str = "") -> Handle:
        """output[N*S] <- concat over ranks of shard[S]. ``shard`` may be a view of output's own slot."""
        n = self.world_size
        assert output.numel() == shard.numel() * n, (output.numel(), shard.numel(), n)
        if n == 1:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return Handle()
        self._count(self.stats.all_gather, output, output.numel(), (n - 1) / n)
        return self._issue("all_gather", label, output, output.numel(), async_op, (output, shard),
                           lambda: _all_gather_single(output, shard, group=self.group, async_op=True))

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, async_op: bool = True,
                       label: str = "") -> Handle:
        """shard[S] <- sum over ranks of this rank's slot of full[N*S] (callers pre-divide to average)."""
        n = self.world_size
        assert full.numel() == shard.numel() * n, (full.numel(), shard.numel(), n)
        if n == 1:
            shard.copy_(full)
            return Handle()
        self._count(self.stats.reduce_scatter, full, full.numel(), (n - 1) / n)
        if self.backend == "gloo":  # See [Note: which reduce-scatter]
            call = lambda: dist.reduce_scatter(shard, list(full.chunk(n)), group=self.group, async_op=True)  # noqa: E731
        else:
            call = lambda: _reduce_scatter_single(shard, full, group=self.group, async_op=True)  # noqa: E731
        return self._issue("reduce_scatter", label, full, full.numel(), async_op, (shard, full), call)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False,
                   label: str = "", count: bool = True) -> Handle:
        """In-place all-reduce; ``op`` is "sum" or "max"."""
        n = self.world_size
        if n == 1:
            return Handle()
        if count:
            self._count(self.stats.all_reduce, tensor, tensor.numel(), 2 * (n - 1) / n)
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        return self._issue(f"all_reduce_{op}", label, tensor, tensor.numel(), async_op, (tensor,),
                           lambda: dist.all_reduce(tensor, op=red, group=self.group, async_op=True))

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank``; see [Note: group ranks]."""
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def broadcast(self, tensor: torch.Tensor, src_rank: int, label: str = "", across_groups: bool = True) -> None:
        """Broadcast from ``src_rank`` (rank within the group): initial weights, user edits of gathered params.

        Hybrid: within every shard group, then (``across_groups``) from the first shard group to
        the others; the object collectives, which agree within a group, pass False."""
        if self.world_size > 1:
            src = self.global_rank(src_rank)
            self._issue("broadcast", label, tensor, tensor.numel(), False, (tensor,),
                        lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True))
        if self.replicas > 1 and across_groups:
            first = dist.get_global_rank(self.replicate_group, 0)
            self._issue("broadcast", label, tensor, tensor.numel(), False, (tensor,),
                        lambda: dist.broadcast(tensor, src=first, group=self.replicate_group, async_op=True))

    def all_reduce_replicas(self, shard: torch.Tensor, label: str = "") -> None:
        """Hybrid sharding: sum a gradient shard over the shard groups (no-op when not hybrid)."""
        n = self.replicas
        if n == 1:
            return
        self._count(self.stats.inter_all_reduce, shard, shard.numel(), 2 * (n - 1) / n)
        self._issue("all_reduce_inter", label, shard, shard.numel(), False, (shard,),
                    lambda: dist.all_reduce(shard, group=self.replicate_group, async_op=True))

    # ------------------------------------------------------------- small objects
    # [Note: bounded object collectives] torch's broadcast_object_list / all_gather_object
    # wait without a bound; these pickle into byte tensors and use the bounded calls above.
    # Like torch's, they unpickle what the other ranks of this job sent.
    def _object_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast_object(self, obj: Any, src_rank: int = 0, label: str = "object") -> Any:
        """Group rank ``src_rank``'s picklable ``obj`` on every rank (checkpoint decisions)."""
        if self.world_size == 1:
            return obj
        device = self._object_device()
        data = pickle.dumps(obj) if self.rank == src_rank else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self.broadcast(size, src_rank, label=label, across_groups=False)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if self.rank == src_rank
               else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
        self.broadcast(buf, src_rank, label=label, across_groups=False)
        return obj if self.rank == src_rank else pickle.loads(buf.cpu().numpy().tobytes())

    def broadcast_object_across_groups(self, obj: Any, label: str = "object") -> Any:
        """Hybrid: the first shard group's ``obj`` on the same place of every shard group."""
        if self.replicas == 1:
            return obj
        device, group = self._object_device(), self.replicate_group
        first, is_src = dist.get_global_rank(group, 0), self.replica_index == 0
        data = pickle.dumps(obj) if is_src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self._issue("broadcast", label, size, 1, False, (size,),
                    lambda: dist.broadcast(size, src=first, group=group, async_op=True))
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if is_src
               else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
        self._issue("broadcast", label, buf, buf.numel(), False, (buf,),
                    lambda: dist.broadcast(buf, src=first, group=group, async_op=True))
        return obj if is_src else pickle.loads(buf.cpu().numpy().tobytes())

    def all_gather_object(self, obj: Any, label: str = "object") -> list:
        """Every rank's picklable ``obj``, in group-rank order."""
        n = self.world_size
        if n == 1:
            return [obj]
        device = self._object_device()
        data = pickle.dumps(obj)
        sizes = torch.zeros(n, dtype=torch.int64, device=device)
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self._issue("all_gather", label, sizes, n, False, (), lambda: _all_gather_single(
            sizes, size, group=self.group, async_op=True))
        width = int(sizes.max().item())
        mine = torch.zeros(width, dtype=torch.uint8, device=device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = torch.empty(width * n, dtype=torch.uint8, device=device)
        self._issue("all_gather", label, everyone, everyone.numel(), False, (), lambda: _all_gather_single(
            everyone, mine, group=self.group, async_op=True))
        raw = everyone.cpu().numpy().tobytes()
        return [pickle.loads(raw[r * width:r * width + int(sizes[r])]) for r in range(n)]


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
