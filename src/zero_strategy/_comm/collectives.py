"""Collectives on flat buffers: all-gather, reduce-scatter, all-reduce; what they count, how they are waited on.

This is the only module that issues ``torch.distributed`` collectives (the gathers it builds
from broadcasts and sends are in _comm/gloo_gathers.py, what a rank knows when one fails in
_comm/faults.py). One collective is one concept here: its call, its counters
(:class:`CommStats`) and its bounded wait (:class:`Handle`). It knows
nothing about modules, hooks or parameters: it moves 1-D tensors and counts the
bytes. A world of one rank takes the same calls and skips the communication, so
every stage runs (and is tested) in a single process.

[Note: which reduce-scatter]
On gloo the list form of ``reduce_scatter`` measured ~1.5x faster than the
single-tensor form for 64 MiB buffers (torch 2.x, 2 CPU ranks), so gloo gets the list
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

[Note: two streams of collectives]
A backend pairs the k-th collective of every rank of a group, so each rank must issue
its collectives in one order. At stage 3 backward issues two kinds: the all-gathers
of units about to run backward (in the gather schedule's order, see [Note: gather
schedule] in _engine/units.py) and the reduce-scatters of groups whose gradients are
complete (in the reduce order, see [Note: reduce order] in _engine/reduce.py). Each kind is
in a fixed order on every rank, but how the two interleave depends on when this
rank's gradients arrive, which depends on what its batch used (an expert its samples
never reached). So at stage 3 the reduce-scatters go to a group of their own over the
same ranks (:meth:`Collectives.split_gradient_stream`, ``dist.new_group`` with local
synchronization), a second *stream* with its own sequence numbers in the flight
recorder and its own checksum: each stream is in lock-step by itself. On NCCL this
also lets a gather and a reduce-scatter run at once, as on two communicators.

[Note: the collective signature]
The flight recorder folds every collective it records (op, label, elements) into a
running CRC-32 per stream. Once per optimizer step (:meth:`Collectives.agree_on_step`,
which also tells which groups any rank has gradients for) every rank adds its
checksums to that small all-reduce, as ``max(c)`` and ``max(-c)``: they are equal on
every rank exactly when every rank issued the same collectives since the last step.
Two collectives of one size that paired across ranks complete without a word (a
gather of expert 2 on one rank summed with a gather of expert 0 on another); this
catches them before the step applies what they computed, on every rank at once.

[Note: coalesced collectives]
A unit with several flat groups (members of an expert list, the root's parts, a block's
persistent group beside its sharded one) would issue one collective per group, and
on gloo each costs 0.5-2 ms to issue and wait beyond its bytes (measured on 2 ranks:
a 720,896 + 68,864 element reduce-scatter pair 4.8-5.9 ms apart, 2.7-3.6 ms as one;
six small all-gathers 3.2 ms apart, 0.6-0.9 ms as one). :meth:`Collectives.all_gather_coalesced`
and :meth:`Collectives.reduce_scatter_coalesced` issue one collective for many flat
buffers, as FSDP2 does for its parameter groups: the shards are packed rank-major
into one buffer ``[N, sum(S_i)]`` (a copy in), one all-gather or reduce-scatter runs
on it, and the all-gather copies each rank's slice back out into every output at its
wait (the reduce-scatter's outputs are views into its one output: no copy out). The
copies cost one pass over the bytes, which for small buffers is below the per-call cost
saved. For a large one it is not: the reduce-scatter's copy in runs in the gradient hook, on
backward's path, where an uncoalesced collective would have run beside backward (a block's
720,896-element group packed with its 68,864-element one made a GPT-2 stage-3 backward
15-20 ms slower per step), so the reduce queue coalesces only groups up to
``COALESCE_REDUCE_ELEMENTS`` (_engine/reduce.py) and reduces larger ones on their own. The flight recorder sees one
collective of the summed size under the caller's label, and the byte counters count
one call of the summed (already padded) sizes, so communication volume is unchanged.
Writes into the outputs keep their autograd version counters, as the uncoalesced
in-place gathers do (stage-3 ``full`` buffers have views saved for backward).

[Note: coalesced gathers of several dtypes]
A unit's groups need not share a dtype: a weight kept in fp32 beside bf16 ones, a 4-bit base's
packed bf16 codes beside fp32 adapters (See [Note: packed 4-bit parameters under ZeRO] in
_model/quantized.py). Packed into the first output's dtype, the others were cast on the way
(fp32 adapters rounded to bf16 at every stage-3 gather). An all-gather moves bytes and sums
nothing, so buffers of several dtypes travel as their raw bytes (each viewed as uint8: the
flat buffers are contiguous and 1-D), one collective still, every value bit for bit. A
reduce-scatter sums in one dtype, so the reduce queue coalesces only groups of one gradient
dtype (_engine/reduce.py); :meth:`Collectives.reduce_scatter_coalesced` refuses a mix.

**What this rank communicated**: per-kind counters behind ``zero_strategy.comm_stats``.

[Note: what the byte counters count]
``volume_elements`` counts the full (unsharded) buffer of every collective, the
convention of the ZeRO paper in which DDP's all-reduce moves 2x the parameters and
stage 3 moves 3x. ``sent_bytes`` is what a bandwidth-optimal (ring) algorithm
actually sends from each rank: (N-1)/N of the volume for all-gather and
reduce-scatter, 2(N-1)/N for all-reduce.

**Waiting for a collective, bounded**: :class:`Handle` and the gloo wait thread.

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
rank: See [Note: naming the rank that failed] in _comm/faults.py. Counting calls costs one
store round trip per call (a forward, a ``state_dict()``), not per collective.

[Note: desync while waiting]
A desync of collectives of different sizes, or of counts, hangs instead. A gloo wait
that has not finished within :data:`DESYNC_CHECK_AFTER` seconds publishes this rank's
flight recorder and compares it with the ones the other ranks published: when a rank
issued a different collective under the same sequence number, every waiting rank
raises :class:`CollectiveDesync` within seconds, naming both collectives (their labels
are unit and group names), instead of waiting ``collective_timeout``. A rank that is
only slow publishes nothing that differs, and the wait goes on to the bound.
"""

from __future__ import annotations

import copy
import ctypes
import datetime
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .faults import (LOCAL, MAIN, CollectiveDesync, CollectiveError, CollectiveTimeout, FlightRecorder, Ledger, Record,
                     desync_diagnosis, diagnosis, find_desync, is_timeout)
from .gloo_gathers import all_gather_by_broadcasts, gather_to, pieces_to
from .objects import ObjectCollectives

__all__ = ["CollectiveDesync", "CollectiveError", "CollectiveTimeout", "Collectives", "CommStats", "Handle",
           "OpCounter", "DESYNC_CHECK_AFTER"]


_torch_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_single(output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = True):
    """torch's all-gather into one tensor, but on gloo broadcasts straight into ``output``:
    See [Note: gloo's all-gather holds its output twice] in _comm/gloo_gathers.py."""
    if dist.get_backend(group) == "gloo":
        return all_gather_by_broadcasts(output, shard, group)
    return _torch_all_gather_single(output, shard, group=group, async_op=async_op)


_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collectives(ObjectCollectives):
    """Collectives over one process group, with byte counters and a flight recorder.

    ``small_tensor_ops`` (scalars for overflow checks and norms) go through
    ``all_reduce``; they are counted too so the volume test sees everything.
    ``wait_timeout``: seconds any wait may take before :class:`CollectiveTimeout`
    (None: the process group's own timeout).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, wait_timeout: float | None = None,
                 replicate_group: dist.ProcessGroup | None = None):
        """``replicate_group``: hybrid sharding, the ranks holding the same shard in the other shard
        groups (See [Note: hybrid sharding] in _comm/hybrid.py); None: ``group`` is the whole data parallel."""
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
        #: how every handle of this group waits, built once (handles are made per collective)
        self.wait_policy = WaitPolicy(wait_timeout, self.handle_timeout, self.backend == "gloo", self.failure,
                                      self.check_desync)
        self.stats = CommStats()
        self.recorder = FlightRecorder()
        #: set once a collective failed here: the group must not be used again (no teardown gather)
        self.failed = False
        self.ledger = None
        #: the stream this object's collectives are recorded under; See [Note: two streams of collectives]
        self.stream = MAIN
        #: where gradient reduce-scatters go: this object, or its twin on a group of their own
        self.gradients: Collectives = self
        self._twin_of: Collectives | None = None
        #: the group of a background thread's collectives (made on first use): See background_channel
        self._background: Collectives | None = None
        if self.world_size > 1:  # group rank 0's fresh token names this engine's records everywhere
            namespace = self.broadcast_object(uuid.uuid4().hex if self.rank == 0 else None, label="setup")
            self.ledger = Ledger(ranks, self.rank, namespace)

    def split_gradient_stream(self) -> None:
        """Give gradient reduce-scatters a group of their own; See [Note: two streams of collectives]."""
        if self.world_size == 1 or self.gradients is not self:
            return
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else list(range(self.world_size))
        twin = copy.copy(self)  # shares the counters, the flight recorder and the ledger
        twin.group = dist.new_group(ranks, backend=self.backend, use_local_synchronization=True)
        twin.stream, twin.gradients, twin._twin_of = "grads", twin, self
        self.gradients = twin

    def background_channel(self) -> "Collectives | None":
        """A gloo group of its own over every rank training the model (hybrid: the whole world), for
        the collectives a background thread issues (an asynchronous checkpoint's agreement), made on
        first use; None in a world of one. Every rank must call it, on its main thread, at the same
        point. See [Note: the agreement of an asynchronous save] in checkpoint/_save.py."""
        if self.data_parallel_size == 1:
            return None
        if self._background is None:
            if self.replicas > 1:
                ranks = list(range(dist.get_world_size()))
            else:
                ranks = (list(dist.get_process_group_ranks(self.group)) if self.group is not None
                         else list(range(dist.get_world_size())))
            group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
            self._background = Collectives(group, wait_timeout=self.wait_timeout)
        return self._background

    def streams(self) -> tuple[str, ...]:
        return (MAIN,) if self.gradients is self else (MAIN, self.gradients.stream)

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
        self._mark_failed()
        if self.ledger is not None:
            self.ledger.publish_flight(self.recorder)
        message = diagnosis(self.ledger, self.recorder, record, self.rank, self.wait_timeout, error)
        self.report_failure(message.splitlines()[0])
        self._abort()
        return (CollectiveTimeout if is_timeout(error) else CollectiveError)(message)

    def _mark_failed(self) -> None:
        self.failed = True
        for other in (self._twin_of, self.gradients):
            if other is not None:
                other.failed = True

    def _abort(self) -> None:
        """Keep the failed groups (both streams) from being destructed, so that this process can exit;
        See [Note: a failed group]."""
        main = self._twin_of or self
        for comm in {id(c): c for c in (main, main.gradients)}.values():
            try:
                pg = comm.group if comm.group is not None else dist.distributed_c10d._get_default_group()
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))  # never destroyed: see the Note
            except Exception as e:  # noqa: BLE001 - best effort: the error message matters more
                print(f"zero_strategy: could not release the process group after a failed collective: {e!r}",
                      file=sys.stderr)

    def check_desync(self) -> None:
        """A wait is taking long: raise :class:`CollectiveDesync` if another rank issued a different
        collective under a sequence number this rank used. See [Note: desync while waiting] in _comm/collectives.py."""
        if self.ledger is None:
            return
        self.ledger.publish_flight(self.recorder)
        theirs = self.ledger.flights()
        if any(find_desync(self.recorder, r, records) for r, records in theirs.items()):
            raise self._desync_error(theirs, "while waiting")

    def _desync_error(self, theirs: dict, when: str) -> CollectiveDesync:
        self._mark_failed()
        message = desync_diagnosis(self.ledger, self.recorder, self.rank, theirs, when)
        self.report_failure(message.splitlines()[0])
        self._abort()
        return CollectiveDesync(message)

    def agree_on_step(self, flags: torch.Tensor) -> torch.Tensor:
        """``flags`` [k] (0/1) maxed over every data-parallel rank, in one small all-reduce that
        also compares the ranks' collective checksums (See [Note: the collective signature]);
        raises :class:`CollectiveDesync` on every rank when they differ."""
        return self.begin_agreement(flags).result()

    def begin_agreement(self, flags: torch.Tensor) -> "PendingAgreement":
        """Start :meth:`agree_on_step` without waiting: the checksums cover the collectives issued
        so far, and ``result()`` waits (the end of backward starts it before waiting for its
        reduce-scatters, so that its latency hides behind theirs)."""
        # 31 bits of each checksum, so that it and its negation fit the int32 flags
        sigs = torch.tensor([c & 0x7FFFFFFF for c in self.recorder.take_signatures(self.streams())], dtype=torch.int32)
        if self.world_size * self.replicas == 1:
            return PendingAgreement(self, flags, None, None, 0)
        packed = torch.cat([flags.to(torch.int32), sigs, -sigs]).to(self._object_device())
        self._count(self.stats.all_reduce, packed, packed.numel(), 2 * (self.world_size - 1) / self.world_size)
        handle = self._issue("all_reduce_max", "step agreement", packed, packed.numel(), True, (packed,),
                             lambda: dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        return PendingAgreement(self, flags, packed, handle, sigs.numel())

    def note_local(self, what: str, label: str) -> None:
        """Fold a local decision every rank must take alike into the collective signature, so that
        the next agreement raises :class:`CollectiveDesync` where ranks took it differently."""
        FlightRecorder.finish(self.recorder.issue(LOCAL + what, label, 0, 0), ok=True)

    def _finish_agreement(self, pending: "PendingAgreement") -> torch.Tensor:
        packed = pending.packed
        pending.handle.wait()
        if self.replicas > 1:
            self._count(self.stats.inter_all_reduce, packed, packed.numel(), 2 * (self.replicas - 1) / self.replicas)
            self._issue("all_reduce_max", "step agreement", packed, packed.numel(), False, (packed,),
                        lambda: dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.replicate_group,
                                                async_op=True))
        packed = packed.cpu()
        k, n = pending.flags.numel(), pending.signatures
        if not torch.equal(packed[k:k + n], -packed[k + n:]):
            theirs = {}
            if self.ledger is not None:
                self.ledger.publish_flight(self.recorder)
                theirs = self.ledger.flights(grace=3.0)
            raise self._desync_error(theirs, "since the last optimizer step")
        return packed[:k].to(pending.flags.dtype)

    def report_failure(self, why: str) -> None:
        """Tell the other ranks (through the store) that this rank gives up, and why."""
        self._mark_failed()
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
        record = self.recorder.issue(op, label, numel, numel * t.element_size(), self.stream)
        try:
            work = call()
        except RuntimeError as e:  # gloo may fail at launch when a peer is already gone
            raise self.failure(record, e) from e
        handle = Handle(work, keep, record, unbounded=op == "reduce_scatter" and self.backend == "gloo",
                        policy=self.wait_policy)
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

    def _all_gather_uncounted(self, output: torch.Tensor, shard: torch.Tensor, label: str) -> None:
        """An all-gather of the object collectives (_comm/objects.py): recorded, not counted as volume."""
        self._issue("all_gather", label, output, output.numel(), False, (),
                    lambda: _all_gather_single(output, shard, group=self.group, async_op=True))

    def gather_to(self, output: torch.Tensor | None, shard: torch.Tensor, dst_rank: int, label: str = "") -> None:
        """output[N*S] <- concat over ranks of shard[S] on group rank ``dst_rank`` only; the others
        pass ``output=None`` and hold nothing beyond their shard. See _comm/gloo_gathers.py."""
        n = self.world_size
        if n == 1:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return
        numel = shard.numel() * n
        self._count(self.stats.all_gather, shard, numel, (n - 1) / n)
        self._issue("gather", label, shard, numel, False, (output, shard),
                    lambda: gather_to(output, shard, dst_rank, group=self.group))

    def pieces_to(self, sends: list[torch.Tensor], receives: dict[int, list[torch.Tensor]] | None,
                  dst_rank: int, numel: int, label: str = "") -> Handle:
        """A gather to group rank ``dst_rank`` straight into the tensors it keeps: there
        ``receives[k]`` is filled from rank k's ``sends``, in order (gloo; See
        _comm/gloo_gathers.py). ``numel``: the gathered whole, for the counters and the recorder.
        Async: the tensors are valid after the handle's ``wait()``."""
        n = self.world_size
        if n == 1:
            return Handle()
        t = sends[0] if sends else next((ts[0] for ts in (receives or {}).values() if ts), torch.empty(0))
        self._count(self.stats.all_gather, t, numel, (n - 1) / n)
        return self._issue("gather", label, t, numel, True, (sends, receives),
                    lambda: pieces_to(sends, receives, dst_rank, group=self.group))

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

    def all_gather_coalesced(self, outputs: list[torch.Tensor], shards: list[torch.Tensor],
                             label: str = "") -> Handle | Then:
        """outputs[i][N*S_i] <- concat over ranks of shards[i][S_i], as one all-gather (async; the
        copies out run at ``wait()``). See [Note: coalesced collectives]."""
        if len(outputs) == 1:
            return self.all_gather(outputs[0], shards[0], async_op=True, label=label)
        n = self.world_size
        if len({o.dtype for o in outputs}) > 1:  # See [Note: coalesced gathers of several dtypes]
            outputs = [o.view(torch.uint8) for o in outputs]
            shards = [s.contiguous().view(torch.uint8) for s in shards]
        sizes = [s.numel() for s in shards]
        packed = torch.empty(n, sum(sizes), dtype=outputs[0].dtype, device=outputs[0].device)
        mine = packed[self.rank]  # [sum(S_i)], this rank's row: what it sends
        torch.cat(shards, out=mine)
        handle = self.all_gather(packed.view(-1), mine, async_op=True, label=label)

        def copy_out() -> None:
            lo = 0
            with torch.no_grad():
                for out, size in zip(outputs, sizes):
                    with torch.autograd._unsafe_preserve_version_counter(out):
                        out.view(n, size).copy_(packed[:, lo:lo + size])
                    lo += size
        return Then(handle, copy_out)

    def reduce_scatter_coalesced(self, fulls: list[torch.Tensor], label: str = ""
                                 ) -> tuple[Handle, list[torch.Tensor]]:
        """One reduce-scatter for several flat buffers: returns the handle and ``outs[i]`` [S_i],
        this rank's summed slot of ``fulls[i]`` [N*S_i] once the handle is waited on (views into
        one output). The inputs are read here: callers may drop them. See [Note: coalesced collectives]."""
        n = self.world_size
        if len({f.dtype for f in fulls}) > 1:  # See [Note: coalesced gathers of several dtypes]
            raise ValueError(f"reduce_scatter_coalesced over several dtypes {sorted({str(f.dtype) for f in fulls})}: "
                             "a sum runs in one dtype; coalesce only buffers of one dtype")
        sizes = [f.numel() // n for f in fulls]
        out = torch.empty(sum(sizes), dtype=fulls[0].dtype, device=fulls[0].device)
        packed = torch.empty(n, sum(sizes), dtype=fulls[0].dtype, device=fulls[0].device)
        lo = 0
        for full, size in zip(fulls, sizes):
            packed[:, lo:lo + size].copy_(full.view(n, size))
            lo += size
        handle = self.reduce_scatter(out, packed.view(-1), async_op=True, label=label)
        return handle, list(out.split(sizes))

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


    # --------------------------------------------------------------- on other groups of these ranks
    # [Note: collectives on other groups]
    # Expert parallelism (_model/expert_parallel.py) exchanges rows and experts on groups of its own
    # (subsets of this object's ranks). They go through here so that comm_stats() counts them and
    # their waits are bounded and fail with this engine's diagnosis and report to the other ranks,
    # like every other collective. They are not put in the flight recorder: their sizes differ by
    # rank (the routing decides how many rows each rank sends), and a rank outside a group issues
    # none of its collectives, so the per-stream checksums and the desync comparison, which assume
    # every rank issues the same sequence, would flag a healthy run. Each call waits before it returns.
    def new_subgroups(self, layouts: list[list[int]]) -> list:
        """One process group per list of global ranks; every rank must create every group, in the same
        order (``dist.new_group``'s rule). :meth:`destroy_subgroups` releases them."""
        return [dist.new_group(ranks) for ranks in layouts]

    def destroy_subgroups(self, groups: list) -> None:
        """Release groups of :meth:`new_subgroups`; kept after a failed collective (See [Note: a failed group])."""
        if self.failed:
            return
        for group in groups:
            dist.destroy_process_group(group)

    def _wait_unrecorded(self, counter: OpCounter, t: torch.Tensor, numel: int, ring_factor: float, keep: tuple,
                         call) -> None:
        self._count(counter, t, numel, ring_factor)
        try:
            work = call()
        except RuntimeError as e:  # gloo may fail at launch when a peer is already gone
            raise self.failure(None, e) from e
        Handle(work, keep, None, policy=self.wait_policy).wait()

    def all_to_all_rows(self, out: torch.Tensor, rows: torch.Tensor, send: list[int], recv: list[int], group) -> None:
        """``out`` [sum(recv), ...] <- ``rows`` [sum(send), ...], whose first ``send[0]`` rows go to rank 0 of
        ``group``, the next ``send[1]`` to rank 1, ...; ``out`` holds rank 0's rows first. Not an autograd op
        (a caller that needs one wraps it, the backward being the reverse exchange)."""
        n = len(send)
        self._wait_unrecorded(self.stats.all_to_all, rows, rows.numel(), (n - 1) / n, (out, rows),
                              lambda: dist.all_to_all_single(out, rows, output_split_sizes=recv,
                                                             input_split_sizes=send, group=group, async_op=True))

    def gather_into(self, parts: list[torch.Tensor] | None, local: torch.Tensor, dst: int, group) -> None:
        """``parts[k]`` <- rank k's ``local`` on global rank ``dst`` of ``group`` (the others pass None)."""
        n = dist.get_world_size(group)
        self._wait_unrecorded(self.stats.all_gather, local, local.numel() * n, (n - 1) / n, (parts, local),
                              lambda: dist.gather(local, parts, dst=dst, group=group, async_op=True))

    def all_gather_into(self, parts: list[torch.Tensor], local: torch.Tensor, group) -> None:
        """``parts[k]`` <- rank k's ``local`` on every rank of ``group``."""
        n = len(parts)
        self._wait_unrecorded(self.stats.all_gather, local, local.numel() * n, (n - 1) / n, (parts, local),
                              lambda: dist.all_gather(parts, local, group=group, async_op=True))

    def all_reduce_in(self, tensor: torch.Tensor, group) -> None:
        """In-place sum of ``tensor`` over ``group``."""
        n = dist.get_world_size(group)
        self._wait_unrecorded(self.stats.all_reduce, tensor, tensor.numel(), 2 * (n - 1) / n, (tensor,),
                              lambda: dist.all_reduce(tensor, group=group, async_op=True))


class PendingAgreement:
    """A step agreement in flight (:meth:`Collectives.begin_agreement`); ``result()`` waits once."""

    def __init__(self, comm: Collectives, flags: torch.Tensor, packed, handle, signatures: int):
        self.comm, self.flags, self.packed, self.handle, self.signatures = comm, flags, packed, handle, signatures
        self._result: torch.Tensor | None = None

    def result(self) -> torch.Tensor:
        """The flags maxed over the ranks; raises :class:`CollectiveDesync` where checksums differ."""
        if self._result is None:
            self._result = self.flags if self.handle is None else self.comm._finish_agreement(self)
        return self._result


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


# ------------------------------------------------- what this rank communicated
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
    #: expert parallelism's exchanges of rows (See [Note: collectives on other groups])
    all_to_all: OpCounter = field(default_factory=OpCounter)

    KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

    def reset(self) -> None:
        self.all_gather = OpCounter()
        self.reduce_scatter = OpCounter()
        self.all_reduce = OpCounter()
        self.inter_all_reduce = OpCounter()
        self.all_to_all = OpCounter()

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


# ---------------------------------------------- waiting for a collective, bounded
#: seconds a gloo wait runs before it looks for a desync; See [Note: desync while waiting]
DESYNC_CHECK_AFTER = 2.0


@dataclass(frozen=True)
class WaitPolicy:
    """How a group's collectives are waited on, built once by the issuing ``Collectives`` and
    shared by every handle it makes (handles are made per collective: one reference each, not
    five fields and two bound methods). ``timeout``: seconds a wait may take (None: unbounded);
    ``bound``: the same as the timedelta torch's ``wait`` takes; ``gloo``: the works are gloo's
    (waited on a thread where needed); ``failure(record, error)``: the error to raise for a failed
    wait; ``check_desync()``: may raise while a gloo wait runs (See [Note: desync while waiting]).
    Callables, so a handle holds two references, not the ``Collectives`` that made it."""

    timeout: float | None
    bound: datetime.timedelta | None
    gloo: bool
    failure: Callable[[Record | None, BaseException], BaseException]
    check_desync: Callable[[], None]


class Handle:
    """An in-flight collective. ``wait()`` is idempotent and keeps tensors alive until then."""

    __slots__ = ("_work", "_keep", "_record", "_unbounded", "_policy")

    def __init__(self, work=None, keep: tuple = (), record: Record | None = None, unbounded: bool = False,
                 policy: WaitPolicy | None = None):
        """``unbounded``: the work's own ``wait(timeout)`` ignores the timeout; See [Note: unbounded works].
        ``policy``: how to wait (None: an unbounded ``work.wait()``)."""
        self._work = work
        self._keep = keep
        self._record = record
        self._unbounded = unbounded
        self._policy = policy

    def wait(self) -> None:
        """Wait for the collective; past the engine's bound, or when a peer is gone, raise
        :class:`CollectiveTimeout` / :class:`CollectiveError` (see [Note: bounded waits])."""
        if self._work is not None:
            work, self._work = self._work, None  # a failed operation is abandoned: never waited on again
            policy = self._policy
            try:
                if policy is None or policy.timeout is None:
                    work.wait()
                elif policy.gloo and (self._unbounded or not work.is_completed()):
                    _wait_on_thread(work, policy.timeout, policy.check_desync)
                else:
                    work.wait(policy.bound)
            except CollectiveDesync:
                self._keep = ()
                raise
            except RuntimeError as e:
                self._keep = ()
                if policy is None:
                    raise
                raise policy.failure(self._record, e) from e
            FlightRecorder.finish(self._record, ok=True)
        self._keep = ()


class Then:
    """A handle whose ``wait()`` waits for ``inner`` and then runs ``after`` once (the copies out
    of a coalesced collective; see [Note: coalesced collectives] in _comm/collectives.py)."""

    __slots__ = ("_inner", "_after")

    def __init__(self, inner, after):
        self._inner, self._after = inner, after

    def wait(self) -> None:
        if self._after is not None:
            after, self._after = self._after, None
            self._inner.wait()  # raises before anything is copied out of a failed collective
            after()


def _wait_on_thread(work, seconds: float, check_desync=None) -> None:
    """``work.wait()`` on a daemon thread, given up after ``seconds``; after
    :data:`DESYNC_CHECK_AFTER` seconds ``check_desync()`` runs every second and may raise
    (See [Note: desync while waiting]).

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
    deadline = time.monotonic() + seconds
    step = min(seconds, DESYNC_CHECK_AFTER)
    while not done.wait(step):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"Operation timed out after {seconds:g} s")
        if check_desync is not None:
            check_desync()
        step = min(left, 1.0)
    if box:
        raise box[0]
