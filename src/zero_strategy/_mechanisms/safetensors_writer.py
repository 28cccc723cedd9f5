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
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

import torch

ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (host copy if needed), without another copy on the host."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class StreamWriter:
    """Write one safetensors file: ``write(name, piece)`` in header order, then ``close()``.

    ``specs``: (name, dtype, shape) of every tensor, in the order they will be written.
    ``close`` flushes and fsyncs and returns (sha256 hex digest, size in bytes). Misuse and
    dtypes safetensors cannot store raise ``error`` (a subclass names its own: checkpoints
    raise ``CheckpointError``).
    """

    error: type[Exception] = ValueError

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, list[int]]],
                 metadata: dict[str, str] | None = None):
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
            raise self.error(f"{self.path}: wrote {name!r} where {expected!r} was expected")
        data = tensor_bytes(piece)
        if self._written + len(data) > self._sizes[self._index][1]:
            raise self.error(f"{self.path}: more bytes for {name!r} than its shape holds")
        self._emit(data)
        self._written += len(data)

    def close(self) -> tuple[str, int]:
        done = sum(n for _, n in self._sizes[:self._index]) + self._written
        if done != sum(n for _, n in self._sizes):
            self.abort()
            raise self.error(f"{self.path}: closed before all tensors were written")
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


def numel_of(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n
