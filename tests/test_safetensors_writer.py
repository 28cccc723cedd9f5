"""The streaming safetensors writer writes a file ``safetensors`` reads back exactly, through its
direct (O_DIRECT) staging and through its buffered fallback, and returns the file's digest (See [Note: direct writes] and [Note: file digests] in _mechanisms/safetensors_writer.py)."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash
from safetensors.torch import load_file

from zero_strategy._mechanisms import safetensors_writer
from zero_strategy._mechanisms.safetensors_writer import StreamWriter, split_digest


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3001, generator=g),                 # not a multiple of a block
            "b": torch.randn(17, 33, generator=g).bfloat16(),
            "empty": torch.empty(0),
            "c": torch.randint(0, 100, (5000,), generator=g)}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_stream_writer_matches_save_file(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(safetensors_writer, "STAGING_BYTES", 3 * 4096)  # many staged writes and a tail
    if not direct:
        monkeypatch.setattr(safetensors_writer.os, "O_DIRECT", 0, raising=False)
    tensors = _tensors()
    specs = [(k, t.dtype, list(t.shape)) for k, t in tensors.items()]
    with StreamWriter(tmp_path / "streamed.safetensors", specs, {"format": "pt"}) as w:
        assert w._direct == (direct and hasattr(os, "O_DIRECT"))
        for k, t in tensors.items():
            if not t.numel():
                continue  # an empty tensor has no bytes to write
            flat = t.reshape(-1)
            for a in range(0, max(1, flat.numel()), 1234):  # pieces across staging boundaries
                w.write(k, flat[a:a + 1234])
        digest, size = w.close()
    data = (tmp_path / "streamed.safetensors").read_bytes()
    assert size == len(data)
    back = load_file(tmp_path / "streamed.safetensors")
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    assert digest == "xxh3_128:" + xxhash.xxh3_128(data).hexdigest()


def test_split_digest_names_what_it_refuses():
    assert split_digest("sha256:" + "ab" * 32) == ("sha256", "ab" * 32)
    with pytest.raises(ValueError, match="unknown digest algorithm 'crc32'"):
        split_digest("crc32:0000abcd")
    with pytest.raises(ValueError, match="is not a sha256 hex digest"):
        split_digest("sha256:" + "AB" * 32)


def _write(path, tensors) -> tuple[str, int]:
    specs = [(k, t.dtype, list(t.shape)) for k, t in tensors.items()]
    with StreamWriter(path, specs, {"format": "pt"}) as w:
        for k, t in tensors.items():
            flat = t.reshape(-1)
            for a in range(0, flat.numel(), 1234):
                w.write(k, flat[a:a + 1234])
        return w.close()


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
@pytest.mark.parametrize("accepted", [0, 2], ids=["first_write_refused", "third_write_refused"])
def test_a_filesystem_refusing_an_aligned_direct_write_gets_the_same_file_buffered(tmp_path, monkeypatch, accepted):
    """``open`` takes O_DIRECT but the filesystem answers a 4 KiB-aligned write with EINVAL (some FUSE
    and network filesystems): the file is written buffered from that byte on, none lost or doubled."""
    import errno
    import fcntl

    monkeypatch.setattr(safetensors_writer, "STAGING_BYTES", 3 * 4096)
    tensors = _tensors()
    buffered = _write_buffered(tmp_path / "buffered.safetensors", tensors, monkeypatch)
    real_write, direct_writes = os.write, []

    def refusing(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            direct_writes.append(len(data))
            if len(direct_writes) > accepted:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refusing)
    got = _write(tmp_path / "refused.safetensors", tensors)
    monkeypatch.setattr(os, "write", real_write)
    assert len(direct_writes) == accepted + 1  # the refused one, then no direct write was tried again
    assert got == buffered
    assert (tmp_path / "refused.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()


def _write_buffered(path, tensors, monkeypatch) -> tuple[str, int]:
    with monkeypatch.context() as m:
        m.setattr(safetensors_writer.os, "O_DIRECT", 0, raising=False)
        return _write(path, tensors)
