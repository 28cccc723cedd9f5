"""Hash a checkpoint file in one pass that also reads planned byte ranges into their final tensors.

[Note: one pass over the optimizer state]
A load verifies every file before it copies anything (See [Note: verify, agree, then copy] in
_load.py). It used to read each file twice: once to hash it, from the disk, and once to copy
its tensors into place, from the page cache the first read filled. On the benchmark machine (2
cores shared with other jobs) the load ran at 0.14-0.70 of the disk's raw ``O_DIRECT`` read:
the disk was not the bound, the two copies through the page cache were (``readinto`` is a
kernel memcpy per byte, paid on a CPU the other jobs also want).

The optimizer state of a resume goes into *fresh* tensors that nothing sees until the commit
installs them, so those bytes can be read into their final place during the verification
itself, and hashed from there: a refused load drops the fresh tensors and has changed nothing.
Only where the optimizer holds no state for the group yet (a resume: See ``_ReadAhead`` in
_load.py), so the load's peak memory stays what it was. Where a fresh tensor takes one
contiguous run of the file, it is allocated so that its bytes sit at the file offset's
alignment modulo 4 KiB (:func:`aligned_like`), with a block of slack on each side, and read
with ``O_DIRECT``: the disk's DMA writes straight into the tensor and the CPU only hashes (xxh3
at ~15 GB/s), each 64 MiB piece while the next one is read. A run that cannot be aligned (one
of several pieces of a re-sharded tensor) is read with a plain ``preadv`` into place: still one
copy, not two.

Everything else (the master shard, which lives in the model; padding; headers) is read into a
scratch buffer through the page cache, with the kernel asked to read ahead of the hash (See
[Note: reading ahead of the hash]), and copied again from the page cache at the commit, as
before. Where ``open`` or a read refuses ``O_DIRECT`` (tmpfs: EINVAL), the run is read the
plain way.
"""

from __future__ import annotations

import errno
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .._mechanisms.aligned import ALIGN
from .._mechanisms.safetensors_writer import DIGESTS
from ._layout import CheckpointError

#: bytes hashed per plain read, and per ``O_DIRECT`` read of a run
CHUNK = 8 << 20
DIRECT_CHUNK = 64 << 20
#: how far ahead of the hash the kernel is asked to read plain runs
PREFETCH_BYTES = 256 << 20


@dataclass
class Run:
    """File bytes [offset, offset + dst.numel()) go to ``dst`` (a contiguous uint8 CPU view).

    ``slack``: the bytes around ``dst`` inside its allocation that a block-aligned read may
    overwrite (See [Note: one pass over the optimizer state]); 0 where it may not."""

    offset: int
    dst: torch.Tensor
    slack: bool = False


def aligned_like(numel: int, dtype: torch.dtype, file_offset: int, at: int = 0) -> torch.Tensor:
    """A fresh 1-D tensor whose element ``at`` lies at ``file_offset``'s alignment modulo ALIGN,
    with ALIGN bytes of slack before and after it: a block-aligned ``O_DIRECT`` read of the file
    bytes starting at ``file_offset`` can land at element ``at`` in place."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel * size + 3 * ALIGN, dtype=torch.uint8)
    start = ALIGN - (raw.data_ptr() + ALIGN) % ALIGN  # raw[start] is block-aligned, start in [1, ALIGN]
    start += (file_offset - at * size) % ALIGN
    return raw[start:start + numel * size].view(dtype)


def merged(runs: list[Run]) -> list[Run]:
    """``runs`` sorted by offset, neighbours contiguous in both the file and memory joined.
    Raises on overlapping runs (a plan bug: the same byte would go to two places)."""
    out: list[Run] = []
    for r in sorted(runs, key=lambda r: r.offset):
        if out:
            last = out[-1]
            end = last.offset + last.dst.numel()
            if r.offset < end:
                raise CheckpointError("internal error: two read-ahead runs overlap in one file")
            if r.offset == end and r.dst.data_ptr() == last.dst.data_ptr() + last.dst.numel() \
                    and r.dst.untyped_storage().data_ptr() == last.dst.untyped_storage().data_ptr():
                joined = torch.empty(0, dtype=torch.uint8).set_(
                    last.dst.untyped_storage(), last.dst.storage_offset(), (last.dst.numel() + r.dst.numel(),))
                out[-1] = Run(last.offset, joined, last.slack and r.slack)
                continue
        out.append(r)
    return out


def hash_into(fd: int, algorithm: str, runs: list[Run]) -> str:
    """``"<algorithm>:<hex>"`` of the open file ``fd``, reading each run's bytes into its ``dst`` on the
    way. See [Note: one pass over the optimizer state]."""
    h = DIGESTS[algorithm]()
    runs = merged(runs)
    scratch = mmap.mmap(-1, CHUNK)
    direct = _open_direct(fd) if any(r.slack for r in runs) else None
    try:
        pos = 0
        for i, run in enumerate(runs):
            pos = _plain(fd, h, scratch, pos, run.offset)
            after = run.offset + run.dst.numel()  # the plain bytes after the run, read ahead while it is
            _advise(fd, after, _upto(after, PREFETCH_BYTES, runs[i + 1].offset if i + 1 < len(runs) else None))
            pos = _run(fd, direct, h, run)
        _plain(fd, h, scratch, pos, None)
    finally:
        if direct is not None:
            os.close(direct)
        try:
            scratch.close()
        except BufferError:  # a view of it held by an error's traceback: freed with it
            pass
    return f"{algorithm}:{h.hexdigest()}"


def _open_direct(fd: int) -> int | None:
    """A second descriptor of the same file (the one verified, even if its name was replaced since)
    that reads with ``O_DIRECT``; None where there is none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # EINVAL: a filesystem without O_DIRECT (tmpfs); ENOENT: no /proc
        return None


def _advise(fd: int, start: int, n: int) -> None:
    """Ask the kernel to read file bytes [start, start + n) ahead of the hash."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None and n > 0:
        advise(fd, start, n, os.POSIX_FADV_WILLNEED)


def _plain(fd: int, h, scratch: mmap.mmap, pos: int, stop: int | None) -> int:
    """Hash file bytes [pos, stop) (None: to the end of the file) read through the page cache, the
    kernel reading a window of PREFETCH_BYTES ahead of the hash; returns where it stopped.

    [Note: reading ahead of the hash]
    A load reads each file twice, once to verify it and once to copy from it (See [Note: verify,
    agree, then copy] in _load.py; a resume's optimizer state once: See [Note: one pass over the
    optimizer state]); the first read comes from the disk, the second from the
    page cache it filled. The kernel is asked for ``PREFETCH_BYTES`` ahead of the hash
    (``POSIX_FADV_WILLNEED``: it reads them without making the hash wait), a window sliding
    with it, so the read-ahead of a file larger than memory cannot evict the pages the hash
    has not reached. Both ranks' files read at once on the benchmark machine (a shared virtual
    disk, figures spread 3x between runs): medians 0.99 GB/s with the window, 0.53 with the
    kernel's own read-ahead, 0.63 with ``POSIX_FADV_SEQUENTIAL``, 0.36 with the whole file
    advised at once; ``O_DIRECT`` in 64 MiB pieces 0.90.
    """
    view = memoryview(scratch)
    _advise(fd, pos, _upto(pos, PREFETCH_BYTES, stop))
    while stop is None or pos < stop:
        n = os.preadv(fd, [view[:_upto(pos, CHUNK, stop)]], pos)
        if not n:
            if stop is None:
                return pos
            raise CheckpointError(f"checkpoint file ended at byte {pos} while it was verified (truncated "
                                  "by another process)")
        h.update(view[:n])
        pos += n
        _advise(fd, pos + PREFETCH_BYTES - n, _upto(pos + PREFETCH_BYTES - n, n, stop))
    return pos


def _upto(start: int, n: int, stop: int | None) -> int:
    """``n``, or fewer so that [start, start + n) ends at ``stop`` (None: no end)."""
    return n if stop is None else max(0, min(n, stop - start))


def _run(fd: int, direct: int | None, h, run: Run) -> int:
    """Read ``run`` into its ``dst`` and hash it; returns the file offset after it."""
    dst = run.dst
    end = run.offset + dst.numel()
    if direct is not None and run.slack and _direct_run(direct, h, run):
        return end
    arr = dst.numpy()
    at = 0
    while at < dst.numel():
        n = os.preadv(fd, [memoryview(arr[at:at + CHUNK])], run.offset + at)
        if not n:
            raise CheckpointError(f"checkpoint file ended at byte {run.offset + at} while it was verified "
                                  "(truncated by another process)")
        h.update(memoryview(arr[at:at + n]))
        at += n
    return end


def _direct_run(fd: int, h, run: Run) -> bool:
    """Read ``run`` with ``O_DIRECT`` in place (its slack takes the block-aligned edges); False
    (nothing hashed) where the alignment does not hold or the filesystem refuses the read."""
    dst, lo = run.dst, run.offset
    hi = lo + dst.numel()
    head = lo % ALIGN
    if (dst.data_ptr() - head) % ALIGN:
        return False
    storage = dst.untyped_storage()
    base = dst.data_ptr() - head
    top = dst.data_ptr() + dst.numel() + (-hi % ALIGN)
    if base < storage.data_ptr() or top > storage.data_ptr() + storage.nbytes():
        return False
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, base - storage.data_ptr(), (top - base,)).numpy()
    file_at = lo - head
    spans = [(at, min(DIRECT_CHUNK, len(whole) - at)) for at in range(0, len(whole), DIRECT_CHUNK)]

    def read(at: int, want: int) -> int:
        return os.preadv(fd, [memoryview(whole[at:at + want])], file_at + at)

    try:
        n = read(*spans[0])
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        return False  # this filesystem takes O_DIRECT at open but not this read
    done = 0
    # the next piece is read while this one is hashed: the disk does not wait for the CPU
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero_strategy load") as pool:
        for i, (at, want) in enumerate(spans):
            ahead = pool.submit(read, *spans[i + 1]) if n == want and i + 1 < len(spans) else None
            # hash only the run's own bytes: the aligned edges belong to the plain bytes around it
            a, b = max(at, head), min(at + n, head + dst.numel())
            if a < b:
                h.update(memoryview(whole[a:b]))
            done = at + n
            if ahead is None:
                break
            n = ahead.result()
    if done < head + dst.numel():
        raise CheckpointError(f"checkpoint file ended at byte {file_at + done} while it was verified "
                              "(truncated by another process)")
    return True
