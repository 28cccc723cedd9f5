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
gathers) and writes it back when it was changed.

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
import errno
import os
import threading
import time
import weakref
from pathlib import Path

import torch

from ._nvme_files import (ALIGN, JobDir, NVMeError, check_room, free_space, prepare_base, remove_stale_job_dirs,
                          reserve, resolve_nvme_path)

__all__ = ["NVMeError", "NVMeStore", "SwapFile", "SlotPool", "aligned_empty", "resolve_nvme_path"]

#: seconds a thread waits for a free staging slot before giving up (a failure wakes it at once)
SLOT_TIMEOUT_S = 300.0
#: seconds one I/O request may take before the store is declared failed
IO_TIMEOUT_S = 300.0


def aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host tensor whose data pointer and size are multiples of ALIGN (for O_DIRECT)."""
    nbytes = _round_up(max(nbytes, 1))
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    offset = (-raw.data_ptr()) % ALIGN
    return raw[offset:offset + nbytes]


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SwapFile:
    """This rank's swap file: one aligned region per swapped tensor, chunked parallel I/O.

    It lives alone in a private, locked directory (see [Note: swap files nobody else can
    touch]); ``reserved`` bytes of it are allocated on disk up front.
    """

    def __init__(self, base: Path, rank: int, io_threads: int, chunk_bytes: int, reserve_bytes: int = 0):
        remove_stale_job_dirs(base)
        self.dir = JobDir(base, rank)
        self.path = self.dir.path / "swap.bin"
        try:
            self.fd, self.direct = self.dir.create_file("swap.bin", direct=hasattr(os, "O_DIRECT"))
            self.reserved = _round_up(reserve_bytes)
            reserve(self.fd, self.path, 0, self.reserved)
        except BaseException:
            if hasattr(self, "fd"):
                os.close(self.fd)
            self.dir.remove()
            raise
        self.chunk = chunk_bytes
        self.regions: dict[str, tuple[int, int]] = {}
        self._end = 0
        self._io = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="zero-nvme-io")
        self.bytes_read = self.bytes_written = 0
        self._lock = threading.Lock()
        # removed when this object is collected or at interpreter exit, whichever is first
        # (a plain atexit.register(self.close) would keep every swap file alive until exit)
        self._finalizer = weakref.finalize(self, _remove_swap_file, self.fd, self.dir, self._io)

    def region(self, key: str, nbytes: int) -> tuple[int, int]:
        with self._lock:
            if key not in self.regions:
                end = self._end + _round_up(nbytes)
                if end > self.reserved:  # beyond the up-front estimate: reserve the growth now
                    reserve(self.fd, self.path, self.reserved, end)
                    self.reserved = end
                self.regions[key] = (self._end, _round_up(nbytes))
                self._end = end
            return self.regions[key]

    @property
    def size(self) -> int:
        return self._end

    def _io_chunk(self, write: bool, buf: torch.Tensor, offset: int) -> None:
        view = memoryview(buf.numpy())
        done = 0
        while done < len(view):
            try:
                n = (os.pwrite(self.fd, view[done:], offset + done) if write
                     else os.preadv(self.fd, [view[done:]], offset + done))
            except OSError as e:
                what = "disk full" if e.errno == errno.ENOSPC else e.strerror
                raise NVMeError(f"NVMe {'write to' if write else 'read from'} {self.path} at byte {offset + done} "
                                f"failed: {what} ({free_space(self.dir.path)} there)") from None
            if n <= 0:
                raise NVMeError(f"NVMe {'write to' if write else 'read from'} {self.path} at byte "
                                f"{offset + done} made no progress (file truncated?)")
            done += n

    def submit(self, write: bool, key: str, buf: torch.Tensor) -> list[concurrent.futures.Future]:
        """Start moving ``buf`` (aligned uint8, region-sized) to/from region ``key``."""
        offset, size = self.regions[key]
        assert buf.numel() == size, (key, buf.numel(), size)
        futures = []
        for start in range(0, size, self.chunk):
            part = buf[start:start + self.chunk]
            futures.append(self._io.submit(self._io_chunk, write, part, offset + start))
        with self._lock:
            if write:
                self.bytes_written += size
            else:
                self.bytes_read += size
        return futures

    def close(self) -> None:
        self._finalizer()


def _remove_swap_file(fd: int, directory: JobDir, io: concurrent.futures.ThreadPoolExecutor) -> None:
    io.shutdown(wait=True, cancel_futures=True)
    with contextlib.suppress(OSError):
        os.close(fd)
    directory.remove()


def wait_all(futures, path: Path | None = None) -> None:
    """Wait for I/O requests; re-raises NVMeError from the I/O thread, or one for a request that hangs."""
    deadline = time.monotonic() + IO_TIMEOUT_S
    for f in futures:
        try:
            f.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise NVMeError(f"an NVMe request on {path or 'the swap file'} did not complete in {IO_TIMEOUT_S:.0f} s "
                            f"({free_space(path.parent) if path else 'free space unknown'}); the disk or its "
                            "filesystem is not responding") from None


class SlotPool:
    """``count`` aligned host buffers; ``acquire`` blocks until one is free (back-pressure)."""

    def __init__(self, count: int, pin: bool):
        self._pin = pin
        self._free: list[torch.Tensor | None] = [None] * count
        self.count = count
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
        if buf is None or buf.numel() < nbytes:
            buf = aligned_empty(nbytes, self._pin)  # grows to the largest swap set seen
        return buf

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
            self._free.append(buf)
            self._cv.notify()

    def buffers(self) -> list[torch.Tensor]:
        return [b for b in self._free if b is not None]


class _SwapSet:
    """Tensors of one group swapped together ("opt": master + optimizer state; "param")."""

    def __init__(self, name: str):
        self.name = name
        self.tensors: dict[str, torch.Tensor] = {}
        self.slot: torch.Tensor | None = None
        self.reads: list = []
        self.resident = True
        #: keys whose .data currently views the slot (tensors adopted while resident do not)
        self.in_slot: set[str] = set()
        self.lock = threading.Lock()



class NVMeStore:
    """The swap file, the slot pool and the residency of every swapped group of one rank."""

    def __init__(self, policy, rank: int, pin: bool, needed_bytes: int):
        directory, default = resolve_nvme_path(policy)
        prepare_base(directory, default)
        check_room(directory, needed_bytes)
        self.directory = directory
        self.policy = policy
        self.file = SwapFile(directory, rank, policy.io_threads, policy.buffer_size, reserve_bytes=needed_bytes)
        # stepping + read-ahead + one write-back, plus (stage 3) this group's parameter shard and the
        # previous one's parameter write-back, must fit at once, or the pipeline waits on itself
        self.pool = SlotPool(max(policy.buffer_count, policy.read_ahead + 4), pin)
        self._sets: dict[tuple[int, str], _SwapSet] = {}
        self._meta: dict[tuple[int, str], dict[str, tuple[torch.dtype, int]]] = {}
        self._finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zero-nvme-evict")
        self._pending_out: list[concurrent.futures.Future] = []
        self._failed: BaseException | None = None

    # ---------------------------------------------------------------- registry
    def _set(self, group, kind: str) -> _SwapSet:
        key = (id(group), kind)
        if key not in self._sets:
            self._sets[key] = _SwapSet(f"{group.name}:{kind}")
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

    def _adopt(self, s: _SwapSet, meta: dict, tensors: dict[str, torch.Tensor], replace: bool) -> None:
        staged = []
        for key, t in tensors.items():
            if key in s.tensors:
                if not replace or s.tensors[key] is t:
                    continue
                old = s.tensors[key]
                if key in s.in_slot:  # resident: take the slot view over, written back on swap-out
                    view = old.data
                    view.copy_(t.detach().reshape(-1))
                    t.data = view
                    s.tensors[key] = t
                    continue
                del s.tensors[key]
            s.tensors[key] = t
            meta[key] = (t.dtype, t.numel())
            fkey = f"{s.name}:{key}"
            _, size = self.file.region(fkey, t.numel() * t.element_size())
            buf = aligned_empty(size, pin=False)
            buf[:t.numel() * t.element_size()].copy_(t.detach().reshape(-1).view(torch.uint8))
            staged.append((buf, self.file.submit(True, fkey, buf)))
        for _, futures in staged:
            wait_all(futures, self.file.path)
        if s.slot is None:  # not inside a residency: evict now
            self._evict(s)

    def needs_adopt(self, group, kind: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        s = self._sets.get((id(group), kind))
        return {k: t for k, t in tensors.items() if s is None or k not in s.tensors}

    def has(self, group, kind: str) -> bool:
        return (id(group), kind) in self._sets

    # --------------------------------------------------------------- residency
    def _slot_bytes(self, key) -> int:
        return sum(_round_up(dt.itemsize * n) for dt, n in self._meta[key].values())

    def _check_healthy(self, s: _SwapSet | None = None) -> None:
        if self._failed is not None:
            if s is not None:
                self._evict(s)  # hand its slot back: nothing may wait on a failed store
            raise NVMeError(f"an earlier NVMe operation on {self.file.path} failed ({self._failed}); the "
                            "swapped training state is incomplete, so it is not read back. Restart from "
                            "the last checkpoint after fixing the disk")

    def _fail(self, err: BaseException, s: _SwapSet | None = None) -> None:
        """Mark the store failed, return ``s``'s slot and wake every slot waiter. See [Note: failures]."""
        if self._failed is None:
            self._failed = err
        self.pool.fail(str(self._failed))
        if s is not None:
            self._evict(s)
        for other in list(self._sets.values()):  # read ahead for a step that will not come: slots back
            if other.slot is not None and not other.resident:
                self._evict(other, only_if_idle=True)

    def prefetch(self, group, kind: str, read: bool = True) -> None:
        """Start reading the set into a slot (no-op if resident or already reading).

        ``read=False`` only takes the slot: for a caller that overwrites every tensor of
        the set (see ``swap_in``).
        """
        s = self._sets[(id(group), kind)]
        self._check_healthy(s)
        with s.lock:
            if s.slot is not None:
                return
            meta = self._meta[(id(group), kind)]
            s.slot = self.pool.acquire(self._slot_bytes((id(group), kind)))
            offset, s.reads = 0, []
            try:
                if self._failed is not None:  # failed while we waited: _fail's sweep may have missed us
                    raise NVMeError(f"NVMe offload stopped: {self._failed}")
                for key, (dt, n) in (meta.items() if read else ()):
                    size = _round_up(dt.itemsize * n)
                    s.reads.extend(self.file.submit(False, f"{s.name}:{key}", s.slot[offset:offset + size]))
                    offset += size
            except BaseException as e:  # e.g. the I/O pool is shut down
                self.pool.release(s.slot)
                s.slot, s.reads = None, []
                self._fail(e)
                raise

    def cancel_prefetch(self, group, kind: str) -> None:
        """Give up a ``prefetch`` that will not be used (no-op if none is pending)."""
        s = self._sets.get((id(group), kind))
        if s is not None:
            self._cancel_prefetch(s)

    def _cancel_prefetch(self, s: _SwapSet) -> None:
        """Drop a read started but not yet made resident (its slot goes back)."""
        with s.lock:
            reads, pending = s.reads, s.slot is not None and not s.resident
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
        self.prefetch(group, kind, read=read)
        with s.lock:
            if s.resident:
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
                    s.tensors[key].data = s.slot[offset:offset + nbytes].view(dt)
                    s.in_slot.add(key)
                    offset += _round_up(nbytes)
                s.resident = True
        if error is not None:
            self._fail(error, s)  # returns the slot; see [Note: failures]
            raise error

    def swap_out(self, group, kind: str, write: bool, wait: bool = True) -> None:
        """Write the set back (if changed) and evict it, freeing its slot."""
        s = self._sets[(id(group), kind)]
        if not s.resident:
            return
        futures = []
        if write and s.slot is not None:
            offset = 0
            for key, (dt, n) in self._meta[(id(group), kind)].items():
                size = _round_up(dt.itemsize * n)
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

    def _evict(self, s: _SwapSet, only_if_idle: bool = False) -> None:
        with s.lock:
            if only_if_idle and s.resident:  # made resident meanwhile: its user releases it
                return
            for t in s.tensors.values():
                t.data = torch.empty(0, dtype=t.dtype)
            s.in_slot.clear()
            if s.slot is not None:
                self.pool.release(s.slot)
                s.slot = None
            s.resident = False

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
        reading = [s.slot for s in self._sets.values() if s.slot is not None and not s.resident]
        return self.pool.buffers() + reading

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.wait_writes()
        self._finisher.shutdown(wait=True)
        self.file.close()
