"""Streaming safetensors: write a file tensor after tensor, read element ranges, hash files.

``safetensors.torch.save_file`` needs every tensor in memory at once. The writer
(_mechanisms/safetensors_writer.py, raising ``CheckpointError`` here) builds the header
from the shapes and dtypes known up front and appends tensor bytes one piece after
another, so it holds at most the piece it is given. The reader reads a range of
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

import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from .._mechanisms.safetensors_writer import split_digest
from .._mechanisms.safetensors_writer import ST_DTYPES as _ST_DTYPES
from .._mechanisms.safetensors_writer import StreamWriter as _Writer
from .._mechanisms.safetensors_writer import element_size as _element_size
from .._mechanisms.safetensors_writer import numel_of as _numel
from ._layout import CheckpointError
from ._one_pass import hash_into
from ._validate import header as library_header

_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


class StreamWriter(_Writer):
    """The safetensors stream writer (_mechanisms/safetensors_writer.py), raising ``CheckpointError``."""

    error = CheckpointError


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

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """``out`` <- flat elements [start, stop) of tensor ``name``: read straight into ``out`` where it is
        a contiguous CPU tensor of the stored dtype (See [Note: one copy into the shard] in _load.py)."""
        dtype = self.dtype(name)
        if out.numel() != stop - start:
            raise CheckpointError(f"{self.path}: {out.numel()} elements asked for [{start}, {stop}) of {name!r}")
        if out.device.type != "cpu" or out.dtype != dtype or not out.is_contiguous() or not out.numel():
            out.copy_(self.read(name, start, stop).view(out.shape))
            return
        entry = self._entry(name)
        size = _element_size(dtype)
        begin, end = entry["data_offsets"]
        if not 0 <= start <= stop <= (end - begin) // size:
            raise CheckpointError(f"{self.path}: elements [{start}, {stop}) of {name!r} out of range "
                                  f"{(end - begin) // size}")
        self._file.seek(self._data_start + begin + start * size)
        got = self._file.readinto(out.detach().view(torch.uint8).reshape(-1).numpy())
        if got != out.numel() * size:
            raise CheckpointError(f"{self.path} is truncated: tensor {name!r} ends past the end of the file")

    def fileno(self) -> int:
        return self._file.fileno()

    def byte_offset(self, name: str, start: int) -> int:
        """Where element ``start`` of tensor ``name`` lies in the file."""
        return self._data_start + self._entry(name)["data_offsets"][0] + start * _element_size(self.dtype(name))

    def close(self) -> None:
        self._file.close()


def check_file(path: Path, digest: str, nbytes: int) -> str:
    """Refuse a file that cannot be what the metadata records before reading a byte of it (a symbolic
    link, missing, another size, a digest that cannot be checked); returns the digest's algorithm."""
    try:
        algorithm, _ = split_digest(digest)
    except ValueError as err:
        raise CheckpointError(f"checkpoint file {path}: its recorded digest cannot be checked: {err}") from None
    if path.is_symlink():
        raise CheckpointError(f"checkpoint file {path} is a symbolic link; checkpoint files are plain files "
                              "inside the checkpoint directory, refusing to follow it")
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if size != nbytes:
        raise CheckpointError(f"checkpoint file {path} is truncated or has the wrong size: "
                              f"{size} bytes, metadata says {nbytes}")
    return algorithm


def verify_file(path: Path, digest: str, nbytes: int, fd: int | None = None, runs: list | None = None) -> None:
    """Refuse a missing, truncated or corrupted file, naming it. ``digest``: ``"<algorithm>:<hex>"``
    as the metadata records it (its algorithm was checked when the metadata was validated); its
    format is one of [Note: file digests] in _mechanisms/safetensors_writer.py. ``fd``: the file
    already open, read through that descriptor; ``runs``: byte ranges read into place while it is
    hashed (See [Note: one pass over the optimizer state] in _one_pass.py)."""
    algorithm = check_file(path, digest, nbytes)
    if fd is None:
        with open(path, "rb", buffering=0) as f:
            got = hash_into(f.fileno(), algorithm, runs or [])
    else:
        got = hash_into(fd, algorithm, runs or [])
    if got != digest:
        raise CheckpointError(f"checkpoint file {path} is corrupted: its {algorithm} digest "
                              f"{got.partition(':')[2][:16]}... does not match the {digest.partition(':')[2][:16]}... "
                              "recorded when it was saved")
