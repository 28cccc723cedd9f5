"""NVMe offload (ZeRO-Infinity): master shards, optimizer state and stage-3 parameter
shards of each flat group live in this rank's swap file and visit host memory only
while they are used.

[Note: residency]
Each flat group's swapped tensors (fp32 master, the optimizer's elementwise state
such as Adam's moments, the parameter shard with ``offload_params="nvme"``) keep
their Python identity (the optimizer's state dict and the master Parameter stay the
same objects). *Resident*, their ``.data`` are views into one slot of a bounded pool
of page-aligned (pinned on CUDA machines) buffers; *evicted*, ``.data`` is an empty
tensor and the bytes are in the swap file. ``resident(group)`` brings a group in
for the code that touches it (the optimizer step, checkpoints, full state dicts,
gathers) and writes it back when it was changed. Each set's state is one
:class:`Residency`: registered in its own memory, evicted, reading into a slot
(a ``prefetch`` in flight), or in its slot.

[Note: the step at disk speed]
The offloaded step walks the groups in order: reads of the next ``read_ahead``
groups are in flight while the worker steps the current one, and its write-back runs
while the next one steps. Reads and writes are split into ``buffer_size`` requests
served by ``io_threads`` threads with O_DIRECT (bypassing the page cache) where the
filesystem allows it, buffered I/O where it does not (e.g. tmpfs).

[Note: failures]
The path is checked before training (created, writable) and this rank's whole swap
size is reserved there (see _mechanisms/nvme_files.py), so a disk too small fails at setup. An
I/O error during training (a full disk on a filesystem that cannot reserve, a
vanished file) raises ``NVMeError`` naming the file, the operation and the free
space, on the rank that hit it, within seconds: the store is marked failed, the
failing set's slot goes back to the pool, and every thread waiting for a slot or an
I/O request wakes and raises too (each wait also has a timeout, ``SLOT_TIMEOUT_S`` /
``IO_TIMEOUT_S``, as a last resort). State is never silently stale: a failed store
refuses to read anything back. The other ranks then fail in their next collective
when the failed process exits (gloo: the peer closed the connection; NCCL: the
launcher stops the job). Swap directories are removed at teardown and at
interpreter exit; those of a crashed run are removed, never read, by a later run
that finds their lock free (see [Note: swap files nobody else can touch]).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

import torch

from .aligned import aligned_empty, round_up
from .nvme_files import NVMeError, check_room, prepare_base, resolve_nvme_path
from .swap_file import SwapFile, wait_all
from .swap_set import Residency, SwapSet
from .transfers import WorkerThreads

__all__ = ["NVMeError", "NVMeStore", "Residency", "SwapFile", "SlotPool", "aligned_empty", "resolve_nvme_path"]

#: seconds a thread waits for a free staging slot before giving up (a failure wakes it at once)
SLOT_TIMEOUT_S = 300.0


class SlotPool:
    """``count`` aligned host buffers of at most ``slot_bytes`` each (or one chunk of
    ``nvme_stream.ALIGN_ELEMS`` elements of each tensor of a set, where that is more);
    ``acquire`` blocks until one is free (back-pressure).

    Staging is bounded by ``count × slot_bytes`` (See [Note: bounded staging] in
    _mechanisms/nvme_stream.py): a set larger than a slot is streamed through slots in
    chunks, never given a slot of its own size. ``acquire_private`` is the one way past the
    bound, for a caller that needs a large set whole (a checkpoint): its buffer is freed at
    ``release``, not kept, and both are counted in the working set.
    """

    def __init__(self, count: int, pin: bool, slot_bytes: int | None = None, working_set=None):
        self._pin = pin
        self._free: list[torch.Tensor | None] = [None] * count
        self.count = count
        self.slot_bytes = slot_bytes
        self._working_set = working_set
        self._private: set[int] = set()  # data_ptr of buffers from acquire_private
        self._cv = threading.Condition()
        self._failed: str | None = None

    def fail(self, reason: str) -> None:
        """The store failed: wake every waiter, and refuse from now on."""
        with self._cv:
            self._failed = reason
            self._cv.notify_all()

    def grow_to(self, count: int) -> None:
        """At least ``count`` slots (buffers are allocated on first use)."""
        with self._cv:
            if count > self.count:
                self._free.extend([None] * (count - self.count))
                self.count = count
                self._cv.notify_all()

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit in one slot."""
        return self.slot_bytes is None or nbytes <= self.slot_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        deadline = time.monotonic() + SLOT_TIMEOUT_S
        with self._cv:
            while not self._free or self._failed:
                if self._failed:
                    raise NVMeError(f"NVMe offload stopped: {self._failed}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NVMeError(f"no NVMe staging buffer came free in {SLOT_TIMEOUT_S:.0f} s (all "
                                    f"{self.count} held); a write-back or read did not finish")
                self._cv.wait(left)
            buf = self._free.pop(self._best_fit(nbytes))
        if buf is None or buf.numel() < nbytes:  # grows to the largest request seen, at most slot_bytes
            old = 0 if buf is None else buf.numel()
            buf = None  # freed before the new one is allocated
            buf = aligned_empty(nbytes, self._pin)
            self._count(old, nbytes)
        return buf

    def acquire_private(self, nbytes: int) -> torch.Tensor:
        """A buffer of its own for a set too large for a slot, freed at ``release``."""
        if self._failed:
            raise NVMeError(f"NVMe offload stopped: {self._failed}")
        buf = aligned_empty(nbytes, self._pin)
        with self._cv:
            self._private.add(buf.data_ptr())
        self._count(0, nbytes)
        return buf

    def _count(self, old: int, new: int) -> None:
        if self._working_set is not None:
            self._working_set.replace("staging", old, new)

    def _best_fit(self, nbytes: int) -> int:
        """Index of the smallest free buffer that holds ``nbytes``; else an unallocated one; else
        the largest (replaced). A small set taking a large buffer would make the next large set
        allocate again, so over a step every slot would grow to the largest set's size."""
        fits = [(b.numel(), i) for i, b in enumerate(self._free) if b is not None and b.numel() >= nbytes]
        if fits:
            return min(fits)[1]
        unallocated = [i for i, b in enumerate(self._free) if b is None]
        if unallocated:
            return unallocated[-1]
        return max(range(len(self._free)), key=lambda i: self._free[i].numel())

    def release(self, buf: torch.Tensor) -> None:
        with self._cv:
            if buf.data_ptr() in self._private:
                self._private.discard(buf.data_ptr())
                self._count(buf.numel(), 0)
                return
            self._free.append(buf)
            self._cv.notify()

    def buffers(self) -> list[torch.Tensor]:
        return [b for b in self._free if b is not None]

    def drop_idle(self) -> None:
        """Free every buffer no one holds (they are allocated again on the next use). See
        [Note: staging between passes] in _mechanisms/memory.py."""
        with self._cv:
            idle, self._free = [b for b in self._free if b is not None], [None] * len(self._free)
        for buf in idle:
            self._count(buf.numel(), 0)


class NVMeStore:
    """The swap file, the slot pool and the residency of every swapped group of one rank."""

    def __init__(self, policy, rank: int, pin: bool, needed_bytes: int, working_set=None):
        directory, default = resolve_nvme_path(policy)
        prepare_base(directory, default)
        check_room(directory, needed_bytes)
        self.directory = directory
        self.policy = policy
        self.file = SwapFile(directory, rank, policy.io_threads, policy.buffer_size, reserve_bytes=needed_bytes)
        # stepping + read-ahead + one write-back, plus (stage 3) this group's parameter shard and the
        # previous one's parameter write-back, must fit at once, or the pipeline waits on itself
        # of buffer_size bytes each: a larger set streams through them (See [Note: bounded staging])
        self.pool = SlotPool(max(policy.buffer_count, policy.read_ahead + 4), pin,
                             slot_bytes=policy.buffer_size, working_set=working_set)
        self._sets: dict[tuple[int, str], SwapSet] = {}
        self._meta: dict[tuple[int, str], dict[str, tuple[torch.dtype, int]]] = {}
        self._finisher = WorkerThreads(1, "zero-nvme-evict")  # started at setup, not in a hook
        self._pending_out: list[concurrent.futures.Future] = []
        self._failed: BaseException | None = None

    # ---------------------------------------------------------------- registry
    def _set(self, group, kind: str) -> SwapSet:
        key = (id(group), kind)
        if key not in self._sets:
            self._sets[key] = SwapSet(f"{group.name}:{kind}")
            self._meta[key] = {}
        return self._sets[key]

    def adopt(self, group, kind: str, tensors: dict[str, torch.Tensor], replace: bool = False) -> None:
        """Start swapping these resident tensors of ``group``: write them out, then evict.

        ``replace``: a key already swapped gets a new tensor object (e.g. optimizer state
        rebuilt by a checkpoint load); inside a residency its values go into the slot.
        """
        s = self._set(group, kind)
        self._check_healthy(s)  # a set resident for a step that ran on: its slot goes back too
        try:
            self._cancel_prefetch(s)  # a read started before these new values exist would bring old ones
            self._adopt(s, self._meta[(id(group), kind)], tensors, replace)
        except BaseException as e:
            self._fail(e, s)
            raise

    def _adopt(self, s: SwapSet, meta: dict, tensors: dict[str, torch.Tensor], replace: bool) -> None:
        staged = []
        for key, t in tensors.items():
            if key in s.tensors:
                if not replace or s.tensors[key] is t:
                    continue
                old = s.tensors[key]
                if key in s.in_slot:  # resident: take the slot view over, written back on swap-out
                    view = old.data
                    view.copy_(t.detach().reshape(view.shape))
                    t.data = view
                    s.tensors[key] = t
                    continue
                del s.tensors[key]
            s.tensors[key] = t
            meta[key] = (t.dtype, t.numel())
            if t.dim() != 1:
                s.shapes[key] = t.shape
            fkey = f"{s.name}:{key}"
            self.file.region(fkey, t.numel() * t.element_size())
            staged.append((fkey, t))
        self._write_out(staged)
        if s.residency is not Residency.IN_SLOT:  # not inside a residency: evict now
            self._evict(s)

    def _write_out(self, staged: list[tuple[str, torch.Tensor]]) -> None:
        """Write whole tensors to their regions through one buffer of at most ``buffer_size``
        bytes (a tensor larger than that goes in pieces): adopting a large group costs no
        aligned copy of its size. Synchronous: adopt runs at setup, at a first step and at a
        checkpoint load, never on a path that overlaps other I/O."""
        limit = self.pool.slot_bytes or 1 << 62
        longest = max((t.numel() * t.element_size() for _, t in staged), default=0)
        if not longest:
            return
        buf = self.pool.acquire_private(min(round_up(longest), round_up(limit)))
        try:
            for fkey, t in staged:
                data = t.detach().reshape(-1).view(torch.uint8)
                for start in range(0, data.numel(), buf.numel()):
                    part = data[start:start + buf.numel()]
                    size = round_up(part.numel())
                    buf[:part.numel()].copy_(part)
                    wait_all(self.file.submit(True, fkey, buf[:size], start=start), self.file.path)
        finally:
            self.pool.release(buf)

    def streamed(self, group, kind: str, planned_bytes: int = 0) -> bool:
        """Whether the set is larger than one staging slot (``planned_bytes``: what it will hold
        once its optimizer state exists), so that it streams in chunks. See [Note: bounded staging]."""
        key = (id(group), kind)
        return key in self._meta and not self.pool.fits(max(self._slot_bytes(key), planned_bytes))

    def needs_adopt(self, group, kind: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the set does not hold yet: new keys, or another object under a key it has
        (state the optimizer built afresh, e.g. after a load left a parameter without any)."""
        s = self._sets.get((id(group), kind))
        return {k: t for k, t in tensors.items() if s is None or s.tensors.get(k) is not t}

    def holds(self, group, kind: str, key: str, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is the object the set swaps under ``key``."""
        s = self._sets.get((id(group), kind))
        return s is not None and s.tensors.get(key) is tensor

    def in_slot(self, group, kind: str) -> bool:
        """Whether the set is resident now (its tensors view its slot)."""
        s = self._sets.get((id(group), kind))
        return s is not None and s.residency is Residency.IN_SLOT

    def keys(self, group, kind: str) -> list[str]:
        """The names of the set's swapped tensors ("master", "state.exp_avg", "param")."""
        return list(self._meta.get((id(group), kind), {}))

    def has(self, group, kind: str) -> bool:
        return (id(group), kind) in self._sets

    def shape_of(self, group, kind: str, key: str) -> torch.Size:
        """The shape the swapped tensor ``key`` has when resident."""
        s = self._sets[(id(group), kind)]
        return s.shapes.get(key, torch.Size([self._meta[(id(group), kind)][key][1]]))

    def alias(self, group, kind: str, key: str, views: list[tuple[torch.Tensor, slice, torch.Size]]) -> None:
        """``views`` (tensor, where, shape) view elements ``where`` of the swapped tensor ``key``,
        shaped ``shape``, whenever it is resident, and are empty while it is evicted (an owned
        group's per-parameter views of its master: See [Note: the ownership layout on NVMe] in
        _optim/owned_runs.py)."""
        s = self._set(group, kind)
        with s.lock:
            s.aliases.extend((t, key, where, shape) for t, where, shape in views)
            s.point_aliases()

    # --------------------------------------------------------------- residency
    def _slot_bytes(self, key) -> int:
        return sum(round_up(dt.itemsize * n) for dt, n in self._meta[key].values())

    def _check_healthy(self, s: SwapSet | None = None) -> None:
        if self._failed is not None:
            if s is not None:
                self._evict(s)  # hand its slot back: nothing may wait on a failed store
            raise NVMeError(f"an earlier NVMe operation on {self.file.path} failed ({self._failed}); the "
                            "swapped training state is incomplete, so it is not read back. Restart from "
                            "the last checkpoint after fixing the disk")

    def fail(self, err: BaseException) -> None:
        """Mark the store failed from outside (a streamed step that stopped part way)."""
        self._fail(err)

    def _fail(self, err: BaseException, s: SwapSet | None = None) -> None:
        """Mark the store failed, return ``s``'s slot and wake every slot waiter. See [Note: failures]."""
        if self._failed is None:
            self._failed = err
        self.pool.fail(str(self._failed))
        if s is not None:
            self._evict(s)
        for other in list(self._sets.values()):  # read ahead for a step that will not come: slots back
            if other.residency is Residency.READING:
                self._evict(other, only_if_idle=True)

    def prefetch(self, group, kind: str, read: bool = True) -> None:
        """Start reading the set into a slot (no-op if resident or already reading, and for a
        set larger than a slot: it streams, or ``swap_in`` reads it whole when asked to).

        ``read=False`` only takes the slot: for a caller that overwrites every tensor of
        the set (see ``swap_in``).
        """
        if self.streamed(group, kind):
            return
        self._prefetch(group, kind, read)

    def _prefetch(self, group, kind: str, read: bool) -> None:
        s = self._sets[(id(group), kind)]
        self._check_healthy(s)
        with s.lock:
            if s.residency in (Residency.READING, Residency.IN_SLOT):
                return
            assert s.residency is Residency.EVICTED, (s.name, s.residency)
            meta = self._meta[(id(group), kind)]
            nbytes = self._slot_bytes((id(group), kind))
            # a set larger than a slot is only ever whole for a caller that needs it so (a
            # checkpoint, a full state dict): a buffer of its own, freed at swap_out
            s.slot = self.pool.acquire(nbytes) if self.pool.fits(nbytes) else self.pool.acquire_private(nbytes)
            s.residency = Residency.READING
            offset, s.reads = 0, []
            try:
                if self._failed is not None:  # failed while we waited: _fail's sweep may have missed us
                    raise NVMeError(f"NVMe offload stopped: {self._failed}")
                for key, (dt, n) in (meta.items() if read else ()):
                    size = round_up(dt.itemsize * n)
                    s.reads.extend(self.file.submit(False, f"{s.name}:{key}", s.slot[offset:offset + size]))
                    offset += size
            except BaseException as e:  # e.g. the I/O pool is shut down
                self.pool.release(s.slot)
                s.slot, s.reads, s.residency = None, [], Residency.EVICTED
                self._fail(e)
                raise

    def cancel_prefetch(self, group, kind: str) -> None:
        """Give up a ``prefetch`` that will not be used (no-op if none is pending)."""
        s = self._sets.get((id(group), kind))
        if s is not None:
            self._cancel_prefetch(s)

    def _cancel_prefetch(self, s: SwapSet) -> None:
        """Drop a read started but not yet made resident (its slot goes back)."""
        with s.lock:
            reads, pending = s.reads, s.residency is Residency.READING
            s.reads = []
        if pending:
            wait_all(reads, self.file.path)
            self._evict(s)

    def swap_in(self, group, kind: str, read: bool = True) -> None:
        """Make the set resident (waiting for its read) with tensors viewing the slot.

        ``read=False``: the caller overwrites every tensor of the set before anything
        reads it (the step's new parameter shard), so the disk read is skipped and the
        slot's stale bytes are never seen; a read already in flight is still waited for.
        """
        s = self._sets[(id(group), kind)]
        self._prefetch(group, kind, read=read)
        with s.lock:
            if s.residency is Residency.IN_SLOT:
                return
            reads, s.reads = s.reads, []
            try:
                wait_all(reads, self.file.path)
            except BaseException as e:
                error = e
            else:
                error = None
                offset = 0
                for key, (dt, n) in self._meta[(id(group), kind)].items():
                    nbytes = dt.itemsize * n
                    view = s.slot[offset:offset + nbytes].view(dt)
                    s.tensors[key].data = view.view(s.shapes[key]) if key in s.shapes else view
                    s.in_slot.add(key)
                    offset += round_up(nbytes)
                s.residency = Residency.IN_SLOT
                s.point_aliases()
        if error is not None:
            self._fail(error, s)  # returns the slot; see [Note: failures]
            raise error

    def swap_out(self, group, kind: str, write: bool, wait: bool = True) -> None:
        """Write the set back (if changed) and evict it, freeing its slot."""
        s = self._sets[(id(group), kind)]
        if s.residency is not Residency.IN_SLOT:
            return
        futures = []
        if write:
            offset = 0
            for key, (dt, n) in self._meta[(id(group), kind)].items():
                size = round_up(dt.itemsize * n)
                if key in s.in_slot:  # adopted-while-resident tensors were written by adopt()
                    futures.extend(self.file.submit(True, f"{s.name}:{key}", s.slot[offset:offset + size]))
                offset += size

        def finish():
            try:
                wait_all(futures, self.file.path)
            except BaseException as e:
                self._fail(e)  # the file no longer holds this state: refuse to read it back
                raise
            finally:
                self._evict(s)  # frees the slot even on failure, so nothing waits on it forever

        if wait:
            finish()
        else:
            self._pending_out.append(self._finisher.submit(finish))

    def _evict(self, s: SwapSet, only_if_idle: bool = False) -> None:
        with s.lock:
            if only_if_idle and s.residency is Residency.IN_SLOT:  # made resident meanwhile: its user releases it
                return
            for t in s.tensors.values():
                t.data = torch.empty(0, dtype=t.dtype)
            s.in_slot.clear()
            if s.slot is not None:
                self.pool.release(s.slot)
                s.slot = None
            s.residency = Residency.EVICTED
            s.point_aliases()

    def wait_writes(self) -> None:
        """Wait for every pending write-back, then raise the first failure (so none is still running)."""
        pending, self._pending_out = self._pending_out, []
        concurrent.futures.wait(pending)
        for f in pending:
            f.result()

    @contextlib.contextmanager
    def resident(self, group, write_back: bool):
        """All swapped sets of ``group`` resident inside the block; written back if asked."""
        kinds = [k for k in ("opt", "param") if self.has(group, k)]
        self.wait_writes()
        for k in kinds:
            self.swap_in(group, k)
        try:
            yield
        finally:
            for k in kinds:
                self.swap_out(group, k, write=write_back)

    # --------------------------------------------------------------- reporting
    def bytes_on_disk(self) -> int:
        return self.file.size

    def staging_tensors(self) -> list[torch.Tensor]:
        """Every staging buffer this rank holds that no model state views: the free ones and
        those a read is filling (resident slots are counted as the states they hold)."""
        reading = [s.slot for s in self._sets.values() if s.residency is Residency.READING]
        return self.pool.buffers() + reading

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.wait_writes()
        self._finisher.shutdown(wait=True)
        self.file.close()
