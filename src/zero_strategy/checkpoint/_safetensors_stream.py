"""Streaming safetensors: write a file tensor after tensor, read element ranges, hash files.

``safetensors.torch.save_file`` needs every tensor in memory at once. Here the
header is built from the shapes and dtypes known up front, then tensor bytes are
appended one piece after another (a piece can be part of a tensor), hashed on the
way, so a writer holds at most the piece it is given. The reader reads a range of
one tensor's elements with ``readinto`` into a fresh buffer, without a memory map
(whose touched pages would stay resident for as long as the file is open).

[Note: who parses the header]
The header of a file we read is parsed and validated by the ``safetensors`` library
first (``_validate.header``: it refuses negative, overlapping or out-of-file offsets
and byte lengths that differ from shape x dtype); ``StreamReader`` then takes the
offsets from the same bytes and checks them again against the library's dtypes and
shapes. It does not read through the library because of a measured cost: streaming a
335 MB file in 16 MB pieces raised peak RSS by 325 MB with ``safe_open(...).get_slice``
(the memory map's touched pages stay resident) and by 20 MB with ``readinto``
(5 x 67 MB fp32 tensors, VmHWM after ``clear_refs``, torch 2.13, safetensors 0.8).

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}`` padded with spaces to a multiple of 8, then the data.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from ._layout import CheckpointError
from ._validate import header as library_header

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}
HASH_CHUNK = 1 << 20  # bytes read at a time when hashing


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (host copy if needed), without another copy on the host."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class StreamWriter:
    """Write one safetensors file: ``write(name, piece)`` in header order, then ``close()``.

    ``specs``: (name, dtype, shape) of every tensor, in the order they will be written.
    ``close`` flushes and fsyncs and returns (sha256 hex digest, size in bytes).
    """

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, list[int]]],
                 metadata: dict[str, str] | None = None):
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        self._sizes: list[tuple[str, int]] = []
        offset = 0
        for name, dtype, shape in specs:
            if dtype not in _ST_DTYPES:
                raise CheckpointError(f"cannot store tensor {name!r} of dtype {dtype} in safetensors")
            nbytes = _element_size(dtype) * _numel(shape)
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": [int(x) for x in shape],
                            "data_offsets": [offset, offset + nbytes]}
            self._sizes.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = Path(path)
        self._hash = hashlib.sha256()
        self._file: BinaryIO = open(self.path, "wb")
        self._size = 0
        self._index = 0        # tensor being written
        self._written = 0      # bytes of it written so far
        self._emit(struct.pack("<Q", len(raw)) + raw)

    def _emit(self, data) -> None:
        self._file.write(data)
        self._hash.update(data)
        self._size += len(data)

    def write(self, name: str, piece: torch.Tensor) -> None:
        """Append ``piece`` (all or the next part of tensor ``name``, any shape, its dtype)."""
        while self._index < len(self._sizes) and self._written == self._sizes[self._index][1]:
            self._index, self._written = self._index + 1, 0
        if self._index >= len(self._sizes) or self._sizes[self._index][0] != name:
            expected = self._sizes[self._index][0] if self._index < len(self._sizes) else "nothing"
            raise CheckpointError(f"{self.path}: wrote {name!r} where {expected!r} was expected")
        data = tensor_bytes(piece)
        if self._written + len(data) > self._sizes[self._index][1]:
            raise CheckpointError(f"{self.path}: more bytes for {name!r} than its shape holds")
        self._emit(data)
        self._written += len(data)

    def close(self) -> tuple[str, int]:
        done = sum(n for _, n in self._sizes[:self._index]) + self._written
        if done != sum(n for _, n in self._sizes):
            self.abort()
            raise CheckpointError(f"{self.path}: closed before all tensors were written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self._hash.hexdigest(), self._size

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


# ------------------------------------------------------------------- reading
class StreamReader:
    """Element ranges of the tensors of one safetensors file, read with plain file I/O."""

    def __init__(self, path: Path):
        self.path = Path(path)
        checked = library_header(self.path)  # See [Note: who parses the header]
        try:
            self._file: BinaryIO = open(self.path, "rb")
            (n,) = struct.unpack("<Q", self._file.read(8))
            header = json.loads(self._file.read(n))
        except (OSError, struct.error, ValueError) as err:
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({err})") from None
        self.metadata: dict = header.pop("__metadata__", {}) or {}
        self.tensors: dict = header
        self._data_start = 8 + n
        self._check_offsets(checked, os.fstat(self._file.fileno()).st_size - self._data_start)

    def _check_offsets(self, checked: dict, data_bytes: int) -> None:
        """Our reading of the offsets agrees with the library's dtypes and shapes, inside the file."""
        if set(checked) != set(self.tensors):
            raise CheckpointError(f"{self.path}: its header lists different tensors than safetensors reads")
        for name, entry in self.tensors.items():
            begin, end = entry["data_offsets"]
            dtype = _TORCH_DTYPES.get(entry["dtype"])
            if (dtype is None or not all(isinstance(x, int) for x in (begin, end))
                    or not 0 <= begin <= end <= data_bytes or list(entry["shape"]) != checked[name][1]
                    or end - begin != _numel(entry["shape"]) * _element_size(dtype)):
                raise CheckpointError(f"{self.path}: tensor {name!r} has offsets {entry['data_offsets']} that do "
                                      f"not fit its dtype, shape or the file")

    def dtype(self, name: str) -> torch.dtype:
        return _TORCH_DTYPES[self._entry(name)["dtype"]]

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name)["shape"])

    def _entry(self, name: str) -> dict:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}") from None

    def read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Flat elements [start, stop) of tensor ``name`` as a new 1-D tensor."""
        entry = self._entry(name)
        dtype = _TORCH_DTYPES[entry["dtype"]]
        size = _element_size(dtype)
        begin, end = entry["data_offsets"]
        total = (end - begin) // size
        stop = total if stop is None else stop
        if not 0 <= start <= stop <= total:
            raise CheckpointError(f"{self.path}: elements [{start}, {stop}) of {name!r} out of range {total}")
        out = torch.empty((stop - start) * size, dtype=torch.uint8)
        self._file.seek(self._data_start + begin + start * size)
        got = self._file.readinto(out.numpy()) if out.numel() else 0
        if got != out.numel():
            raise CheckpointError(f"{self.path} is truncated: tensor {name!r} ends past the end of the file")
        return out.view(dtype)

    def close(self) -> None:
        self._file.close()


def sha256_file(path: Path, chunk: int = HASH_CHUNK) -> str:
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def verify_file(path: Path, sha256: str, nbytes: int) -> None:
    """Refuse a missing, truncated or corrupted file, naming it."""
    if path.is_symlink():
        raise CheckpointError(f"checkpoint file {path} is a symbolic link; checkpoint files are plain files "
                              "inside the checkpoint directory, refusing to follow it")
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if size != nbytes:
        raise CheckpointError(f"checkpoint file {path} is truncated or has the wrong size: "
                              f"{size} bytes, metadata says {nbytes}")
    digest = sha256_file(path)
    if digest != sha256:
        raise CheckpointError(f"checkpoint file {path} is corrupted: its sha256 {digest[:16]}... does not "
                              f"match the {sha256[:16]}... recorded when it was saved")
