"""A resume reads its optimizer state once: while the file is hashed, into the fresh tensors the
commit installs (issue 42; See [Note: one pass over the optimizer state] in checkpoint/_one_pass.py).

Before, every file was read twice, once to verify its digest and once to copy it into place, and
the load ran at 0.14-0.70 of the disk's raw read. The state read ahead must be exactly the saved
state (also where a tensor's run is read with ``O_DIRECT`` at its file offset's alignment, and
where the filesystem refuses ``O_DIRECT``), and a refused load must still change nothing: the
fresh tensors are never installed.
"""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

import zero_strategy as zs
from _refused_load import differences, flip_a_byte, snapshot
from zero_strategy.checkpoint import _one_pass

RANK_FILE = "rank00000-of-00001.safetensors"


def _model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.Linear(384, 256), torch.nn.Linear(256, 7))
    return zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zs.ZeroConfig(stage=2))


def _trained(path):
    model, opt = _model(seed=1)
    for _ in range(2):
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    zs.save_checkpoint(path, model, opt)
    return model, opt


def _state(opt) -> dict:
    return {f"{i}.{k}": v for i, s in opt.state_dict()["optimizer"]["state"].items() for k, v in s.items()}


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads bytes read from /proc/self/io")
def test_a_resume_reads_the_optimizer_state_from_its_file_once(tmp_path):
    _trained(tmp_path / "ckpt")
    size = (tmp_path / "ckpt" / RANK_FILE).stat().st_size
    model, opt = _model()
    before = _rchar()
    zs.load_checkpoint(tmp_path / "ckpt", model, opt)
    read = _rchar() - before
    # the file once to hash it (the state read into place on the way), the master third again to copy it;
    # reading everything twice was 2 x size
    assert read < 1.5 * size, (read, size)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "refused_o_direct"])
def test_the_state_read_ahead_is_the_saved_state(direct, tmp_path, monkeypatch):
    saved_model, saved_opt = _trained(tmp_path / "ckpt")
    if not direct:  # a filesystem that refuses O_DIRECT (tmpfs): the runs are read the plain way
        monkeypatch.setattr(_one_pass, "_open_direct", lambda fd: None)
    model, opt = _model()
    zs.load_checkpoint(tmp_path / "ckpt", model, opt)
    got, want = _state(opt), _state(saved_opt)
    assert got.keys() == want.keys() and len(got) == 9
    for k, v in want.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
    weights, saved = zs.full_state_dict(model, dtype=None), zs.full_state_dict(saved_model, dtype=None)
    assert all(torch.equal(weights[k], v) for k, v in saved.items())


def test_a_refused_resume_installs_none_of_the_state_it_read(tmp_path):
    _trained(tmp_path / "ckpt")
    flip_a_byte(tmp_path / "ckpt" / RANK_FILE)  # in the middle: the optimizer state, read ahead
    model, opt = _model()
    before = snapshot(model, opt)
    with pytest.raises(zs.CheckpointError, match="corrupted"):
        zs.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert differences(before, snapshot(model, opt)) == []
    assert _state(opt) == {}


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "plain"])
def test_hashing_while_reading_into_place_gives_the_files_digest_and_bytes(direct, tmp_path, monkeypatch):
    if not direct:
        monkeypatch.setattr(_one_pass, "_open_direct", lambda fd: None)
    monkeypatch.setattr(_one_pass, "DIRECT_CHUNK", 3 * 4096)  # many direct pieces, each hashed as the next is read
    data = torch.randint(0, 256, (3 * _one_pass.CHUNK + 12345,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "f"
    path.write_bytes(data.numpy().tobytes())
    # an aligned tensor at an odd offset, a plain run right after it, one ending at the file's end
    spans = [(4097 + 3, 2 * _one_pass.CHUNK + 5), (4097 + 3 + 2 * _one_pass.CHUNK + 5, 1000),
             (data.numel() - 77, 77)]
    dsts = [_one_pass.aligned_like(spans[0][1], torch.uint8, spans[0][0]), torch.empty(1000, dtype=torch.uint8),
            _one_pass.aligned_like(77, torch.uint8, spans[2][0])]
    runs = [_one_pass.Run(o, d, slack=d.numel() != 1000) for (o, _), d in zip(spans, dsts)]
    with open(path, "rb") as f:
        got = _one_pass.hash_into(f.fileno(), "xxh3_128", runs)
    assert got == "xxh3_128:" + xxhash.xxh3_128(data.numpy().tobytes()).hexdigest()  # the bytes' own digest
    for (o, n), d in zip(spans, dsts):
        assert torch.equal(d, data[o:o + n])
