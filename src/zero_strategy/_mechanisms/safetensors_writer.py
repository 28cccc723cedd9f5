"""Write one safetensors file tensor after tensor, holding at most the piece being written.

``safetensors.torch.save_file`` needs every tensor in memory at once. Here the header is
built from the shapes and dtypes known up front, then tensor bytes are appended one piece
after another (a piece can be part of a tensor), hashed on the way. Checkpoint
consolidation (checkpoint/_consolidate.py) streams a checkpoint's pieces through it and
the engine's streamed ``save_pretrained`` (_model/hf.py) a stage-3 model's
units, so neither holds the whole model.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}`` padded with spaces to a multiple of 8, then the data.

[Note: file digests]
A digest is written ``<algorithm>:<hex>``, so a reader knows how to check it without
guessing from its length. New files get ``xxh3_128`` (the ``xxhash`` library): a
checksum against damage (a flipped bit, a truncated copy, an edit by a tool), which is
what the per-file digests of a checkpoint are for; the metadata that lists them carries
its own sha256 (_validate.py). Nothing is lost against a forger: one who can rewrite a
file could always rewrite its recorded sha256 too and re-sign the metadata (SECURITY.md).
Measured on the 2-core benchmark machine: sha256 1.58 GB/s, zlib.crc32 4 GB/s, xxh3_128
14.7 GB/s; at sha256's rate, hashing a rank's file took longer than the disk took to
write both ranks' files. ``sha256`` stays readable: checkpoints of format version 1
(a bare sha256 hex per file) still verify. An algorithm not in ``DIGESTS`` is refused
by name, never skipped.

[Note: direct writes]
Where the filesystem allows ``O_DIRECT`` (Linux ext4, xfs...; not macOS), the
writer copies the bytes it is given into an aligned staging buffer of ``STAGING_BYTES`` and
writes each full buffer straight to the disk, bypassing the page cache: a save is one copy
per byte, as a buffered write is, but it does not leave gigabytes of dirty pages for the
kernel to write back and then evict (a save's buffered writes plus its final fsync ran at
0.3 of the disk's O_DIRECT rate on the benchmark machine). The last bytes that do not fill
a whole block are written after ``O_DIRECT`` is cleared on the descriptor; ``close`` still
fsyncs (the file's size and blocks). Where ``open`` refuses ``O_DIRECT`` (EINVAL: a
filesystem without it) the writer falls back to buffered writes. A filesystem may also take
the flag at ``open`` and refuse the aligned write itself with EINVAL (some FUSE and network
filesystems): a write that fails so has written nothing, so the writer clears ``O_DIRECT`` on
the descriptor and writes the same bytes again, buffered, as it does every later byte of that
file (See :meth:`StreamWriter._write`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Protocol

import torch
import xxhash

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


#: digest algorithms a checkpoint may name; See [Note: file digests]
DIGESTS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
#: the hex length of each algorithm's digest
DIGEST_HEX = {"xxh3_128": 32, "sha256": 64}
DIGEST = "xxh3_128"  # what new files get
#: bytes staged per direct write; See [Note: direct writes]
STAGING_BYTES = 16 << 20
_BLOCK = 4096  # O_DIRECT's alignment of offsets, lengths and buffers (a page; covers 512-byte disks)


class HoldsBuffers(Protocol):
    """Who counts a writer's staging buffer while the file is open (a model's ``BackgroundSave``)."""

    def hold(self, t: torch.Tensor) -> None: ...

    def release(self, t: torch.Tensor) -> None: ...


def split_digest(digest: str) -> tuple[str, str]:
    """``"<algorithm>:<hex>"`` -> (algorithm, hex); raises ValueError naming what is wrong."""
    algorithm, sep, hexdigest = digest.partition(":") if isinstance(digest, str) else ("", "", "")
    if not sep:
        raise ValueError(f"{digest!r} is not '<algorithm>:<hex digest>'")
    if algorithm not in DIGESTS:
        raise ValueError(f"unknown digest algorithm {algorithm!r} (this zero_strategy verifies "
                         f"{', '.join(sorted(DIGESTS))})")
    if len(hexdigest) != DIGEST_HEX[algorithm] or hexdigest.strip("0123456789abcdef"):
        raise ValueError(f"{hexdigest!r} is not a {algorithm} hex digest ({DIGEST_HEX[algorithm]} hex digits)")
    return algorithm, hexdigest


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (host copy if needed), without another copy on the host."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class StreamWriter:
    """Write one safetensors file: ``write(name, piece)`` in header order, then ``close()``.

    ``specs``: (name, dtype, shape) of every tensor, in the order they will be written.
    ``close`` flushes and fsyncs and returns (``"xxh3_128:<hex>"``, size in bytes): See [Note: file
    digests] and [Note: direct writes]. Misuse and
    dtypes safetensors cannot store raise ``error`` (a subclass names its own: checkpoints
    raise ``CheckpointError``).
    """

    error: type[Exception] = ValueError

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, list[int]]],
                 metadata: dict[str, str] | None = None, held_by: "HoldsBuffers | None" = None):
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._sizes: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in specs:
            if dtype not in ST_DTYPES:
                raise self.error(f"cannot store tensor {name!r} of dtype {dtype} in safetensors")
            nbytes = element_size(dtype) * numel_of(shape)
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": [int(x) for x in shape],
                            "data_offsets": [offset, offset + nbytes]}
            self._sizes.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = Path(path)
        self._hash = DIGESTS[DIGEST]()
        self._fd, self._direct = _open_for_writing(self.path)
        self._closed = False
        # See [Note: direct writes]: the staging buffer and its fill. An anonymous map (page-aligned),
        # unmapped at close, not a malloc'd tensor: freeing 16 MiB through malloc would raise glibc's
        # mmap threshold for the whole process. ``held_by`` counts it while the file is open, as a
        # tensor over the map (memory_report's "staging" reads its size; the view is dropped before
        # the map is closed, and it does not keep the map alive: nothing may read its data).
        self._map = mmap.mmap(-1, STAGING_BYTES) if self._direct else None
        self._stage = torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None else None
        self._held_by = held_by if self._stage is not None else None
        if self._held_by is not None:
            self._held_by.hold(self._stage)
        self._staged = 0
        self._size = 0
        self._index = 0        # tensor being written
        self._written = 0      # bytes of it written so far
        self._emit(memoryview(struct.pack("<Q", len(raw)) + raw))

    def _emit(self, data: memoryview) -> None:
        self._hash.update(data)
        self._size += len(data)
        if self._stage is None:
            self._write(data)
            return
        view = memoryview(self._map)
        while len(data):
            n = min(len(data), STAGING_BYTES - self._staged)
            view[self._staged:self._staged + n] = data[:n]
            self._staged += n
            data = data[n:]
            if self._staged == STAGING_BYTES:
                self._write(view)
                self._staged = 0

    def _flush_staged(self) -> None:
        """Write what is staged: whole blocks directly, the rest after clearing O_DIRECT."""
        if self._stage is None:
            return
        view = memoryview(self._map)
        whole = self._staged - self._staged % _BLOCK
        if whole:
            self._write(view[:whole])
        if whole < self._staged:
            self._buffered()
            self._write(view[whole:self._staged])
        self._staged = 0

    def _write(self, data: memoryview) -> None:
        """Append ``data`` to the file. A direct write the filesystem refuses (EINVAL) wrote nothing:
        the same bytes go again through the page cache, as does the rest of the file (See [Note:
        direct writes])."""
        while len(data):
            try:
                n = os.write(self._fd, data)
            except OSError as err:
                if err.errno != errno.EINVAL or not self._direct:
                    raise
                self._buffered()
                continue
            data = data[n:]

    def _buffered(self) -> None:
        """Clear ``O_DIRECT`` on the descriptor: the following writes go through the page cache."""
        if self._direct:
            import fcntl  # only here: O_DIRECT exists where fcntl does

            fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self._direct = False

    def write(self, name: str, piece: torch.Tensor) -> None:
        """Append ``piece`` (all or the next part of tensor ``name``, any shape, its dtype)."""
        while self._index < len(self._sizes) and self._written == self._sizes[self._index][1]:
            self._index, self._written = self._index + 1, 0
        if self._index >= len(self._sizes) or self._sizes[self._index][0] != name:
            expected = self._sizes[self._index][0] if self._index < len(self._sizes) else "nothing"
            raise self.error(f"{self.path}: wrote {name!r} where {expected!r} was expected")
        data = tensor_bytes(piece).cast("B")
        if self._written + len(data) > self._sizes[self._index][1]:
            raise self.error(f"{self.path}: more bytes for {name!r} than its shape holds")
        self._emit(data)
        self._written += len(data)

    def close(self) -> tuple[str, int]:
        done = sum(n for _, n in self._sizes[:self._index]) + self._written
        if done != sum(n for _, n in self._sizes):
            self.abort()
            raise self.error(f"{self.path}: closed before all tensors were written")
        try:
            self._flush_staged()
            os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        self._release()
        return f"{DIGEST}:{self._hash.hexdigest()}", self._size

    def abort(self) -> None:
        self._release()

    def _release(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)
            stage, self._stage = self._stage, None
            if self._held_by is not None:
                self._held_by.release(stage)
            del stage  # the map's last export, unless a report holds it now
            stage_map, self._map = self._map, None
            if stage_map is not None:
                try:
                    stage_map.close()
                except BufferError:  # a view of it still held (a report, an error's traceback): freed with it
                    pass

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def _open_for_writing(path: Path) -> tuple[int, bool]:
    """A descriptor for a new file at ``path`` and whether it writes directly (See [Note: direct writes])."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError as err:
            if err.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT (tmpfs)
                raise
    return os.open(path, flags, 0o644), False


def numel_of(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n
