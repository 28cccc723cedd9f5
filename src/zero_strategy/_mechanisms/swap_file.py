"""This rank's NVMe swap file: one aligned region per swapped tensor, read and written in
requests of at most ``buffer_size`` bytes by a pool of I/O threads (O_DIRECT where the
filesystem allows it). Leaf of the NVMe store (_mechanisms/nvme.py), which decides what
is read and written when.
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

from .aligned import round_up
from .nvme_files import JobDir, NVMeError, free_space, remove_stale_job_dirs, reserve
from .transfers import WorkerThreads

__all__ = ["IO_TIMEOUT_S", "SwapFile", "wait_all"]

#: seconds one I/O request may take before the store is declared failed
IO_TIMEOUT_S = 300.0


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
            self.reserved = round_up(reserve_bytes)
            reserve(self.fd, self.path, 0, self.reserved)
        except BaseException:
            if hasattr(self, "fd"):
                os.close(self.fd)
            self.dir.remove()
            raise
        self.chunk = chunk_bytes
        self.regions: dict[str, tuple[int, int]] = {}
        self._end = 0
        self._io = WorkerThreads(io_threads, "zero-nvme-io")  # started now, at setup: see its module
        self.bytes_read = self.bytes_written = 0
        self._lock = threading.Lock()
        # removed when this object is collected or at interpreter exit, whichever is first
        # (a plain atexit.register(self.close) would keep every swap file alive until exit)
        self._finalizer = weakref.finalize(self, _remove_swap_file, self.fd, self.dir, self._io)

    def region(self, key: str, nbytes: int) -> tuple[int, int]:
        with self._lock:
            if key not in self.regions:
                end = self._end + round_up(nbytes)
                if end > self.reserved:  # beyond the up-front estimate: reserve the growth now
                    reserve(self.fd, self.path, self.reserved, end)
                    self.reserved = end
                self.regions[key] = (self._end, round_up(nbytes))
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

    def submit(self, write: bool, key: str, buf: torch.Tensor, start: int = 0) -> list[concurrent.futures.Future]:
        """Start moving ``buf`` (aligned uint8) to/from region ``key`` from its byte ``start`` on.

        Whole regions (``start`` 0, ``buf`` region-sized) or, for a streamed group, a range of
        one (``start`` a multiple of 4096, so O_DIRECT's alignment holds; see _mechanisms/nvme_stream.py).
        """
        offset, size = self.regions[key]
        assert start % 4096 == 0 and start + buf.numel() <= size, (key, start, buf.numel(), size)
        futures = []
        for part_start in range(0, buf.numel(), self.chunk):
            part = buf[part_start:part_start + self.chunk]
            futures.append(self._io.submit(self._io_chunk, write, part, offset + start + part_start))
        with self._lock:
            if write:
                self.bytes_written += buf.numel()
            else:
                self.bytes_read += buf.numel()
        return futures

    def close(self) -> None:
        self._finalizer()


def _remove_swap_file(fd: int, directory: JobDir, io: WorkerThreads) -> None:
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
