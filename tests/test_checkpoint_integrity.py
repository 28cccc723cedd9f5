"""Damaged or mismatched checkpoints are refused with errors that name the problem."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import xxhash

import zero_strategy as zs
from _models import TinyLM, param_groups

RANK_FILE = "rank00000-of-00001.safetensors"


def _tiny(layers: int = 2, optimizer: str = "adamw"):
    torch.manual_seed(0)
    model = TinyLM(layers=layers)
    opt = torch.optim.AdamW(param_groups(model)) if optimizer == "adamw" else \
        torch.optim.SGD(param_groups(model), momentum=0.9)
    return zs.setup(model, opt, zs.ZeroConfig(stage=2))


@pytest.fixture
def ckpt(tmp_path):
    model, opt = _tiny()
    tokens = torch.randint(0, 37, (2, 8))
    model(tokens).float().mean().backward()
    opt.step()
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    torch.save({"weights": zs.full_state_dict(model), "optimizer": opt.state_dict()}, tmp_path / "saved.pt")
    return tmp_path / "ckpt"


def _load(path, **kw):
    model, opt = _tiny(**{k: kw.pop(k) for k in ("layers", "optimizer") if k in kw})
    return zs.load_checkpoint(path, model, kw.pop("opt", opt), **kw)


def test_intact_checkpoint_loads_what_was_saved(ckpt):
    """The control for the damaged cases below: the same checkpoint, untouched, loads the saved
    weights and optimizer state into a fresh model."""
    saved = torch.load(ckpt.parent / "saved.pt", weights_only=True)
    model, opt = _tiny()
    fresh = zs.full_state_dict(model)
    assert any(not torch.equal(fresh[k], v) for k, v in saved["weights"].items())  # the step moved them
    zs.load_checkpoint(ckpt, model, opt)
    loaded = zs.full_state_dict(model)
    assert loaded.keys() == saved["weights"].keys()
    for k, v in saved["weights"].items():
        assert torch.equal(loaded[k], v), k
    state, want = opt.state_dict()["optimizer"]["state"], saved["optimizer"]["optimizer"]["state"]
    assert state.keys() == want.keys() and state
    for i in want:
        for name, t in want[i].items():
            assert torch.equal(state[i][name], t), (i, name)


def _flip_a_byte(f) -> None:
    """One bit pattern changed in the middle of file ``f``: damage a size check cannot see."""
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def test_corrupted_shard_is_named(ckpt):
    _flip_a_byte(ckpt / RANK_FILE)
    with pytest.raises(zs.CheckpointError, match=f"{RANK_FILE} is corrupted: its xxh3_128 digest"):
        _load(ckpt)
    with pytest.raises(zs.CheckpointError, match=f"{RANK_FILE} is corrupted: its xxh3_128 digest"):
        zs.checkpoint.consolidate(ckpt, ckpt.parent / "out")
    assert not (ckpt.parent / "out").exists()


def _as_version_1(ckpt) -> None:
    """Rewrite a checkpoint's metadata as a version-1 save recorded it (each file's bare sha256 hex
    under ``sha256``, the only difference of that format), re-signed as that version signed it."""
    from zero_strategy.checkpoint._validate import digest

    meta = json.loads((ckpt / "metadata.json").read_text())
    meta["version"] = 1
    for rec in meta["files"]:
        del rec["digest"]
        rec["sha256"] = hashlib.sha256((ckpt / rec["name"]).read_bytes()).hexdigest()
    meta["checksum"] = digest(meta)
    (ckpt / "metadata.json").write_text(json.dumps(meta, indent=1))


def test_new_files_record_an_xxh3_digest(ckpt):
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["version"] == 2
    for rec in meta["files"]:
        assert rec["digest"] == "xxh3_128:" + xxhash.xxh3_128((ckpt / rec["name"]).read_bytes()).hexdigest()


def test_version_1_checkpoint_with_sha256_digests_loads_and_consolidates(ckpt):
    _as_version_1(ckpt)
    test_intact_checkpoint_loads_what_was_saved(ckpt)
    assert zs.checkpoint.consolidate(ckpt, ckpt.parent / "out").is_dir()


def test_version_1_corrupted_file_is_refused_by_its_sha256(ckpt):
    _as_version_1(ckpt)
    _flip_a_byte(ckpt / RANK_FILE)
    with pytest.raises(zs.CheckpointError, match=f"{RANK_FILE} is corrupted: its sha256 digest"):
        _load(ckpt)


@pytest.mark.parametrize("edit, message", [
    (lambda rec: rec.update(digest="md5:" + "0" * 32), r"files\[0\]\.digest: unknown digest algorithm 'md5'"),
    (lambda rec: rec.update(digest="0" * 32), r"files\[0\]\.digest: '0{32}' is not '<algorithm>:<hex digest>'"),
    (lambda rec: rec.update(digest="xxh3_128:" + "0" * 64), r"files\[0\]\.digest: '0{64}' is not a xxh3_128 hex"),
    (lambda rec: rec.update(sha256=rec.pop("digest")), r"files\[0\]: unknown key\(s\) \['sha256'\]"),
])
def test_a_digest_that_cannot_be_checked_is_refused_by_name(ckpt, edit, message):
    """Re-signed metadata whose file digest names an algorithm this version does not verify, or
    is malformed, is refused before any file is read: never skipped, never guessed."""
    from zero_strategy.checkpoint._validate import digest

    meta = json.loads((ckpt / "metadata.json").read_text())
    edit(meta["files"][0])
    meta["checksum"] = digest(meta)
    (ckpt / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(zs.CheckpointError, match=message):
        _load(ckpt)
    with pytest.raises(zs.CheckpointError, match=message):
        zs.checkpoint.consolidate(ckpt, ckpt.parent / "out")
    assert not (ckpt.parent / "out").exists()


def test_truncated_shard_is_named(ckpt):
    f = ckpt / RANK_FILE
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(zs.CheckpointError, match=f"{RANK_FILE} is truncated"):
        _load(ckpt)


def test_missing_rank_file(ckpt):
    (ckpt / RANK_FILE).unlink()
    with pytest.raises(zs.CheckpointError, match=f"{RANK_FILE} is missing"):
        _load(ckpt)


def test_unknown_format_version(ckpt):
    meta = json.loads((ckpt / "metadata.json").read_text())
    meta["version"] = 99
    (ckpt / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(zs.CheckpointError, match="unknown checkpoint format version 99"):
        _load(ckpt)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(zs.CheckpointError, match="no metadata.json"):
        _load(tmp_path / "x")
    with pytest.raises(zs.CheckpointError, match="no checkpoint at"):
        _load(tmp_path / "nothing")


def test_parameters_missing_from_checkpoint_are_listed(ckpt):
    with pytest.raises(zs.CheckpointError, match=r"missing from the checkpoint: \['layers.2.fc1.bias'") as err:
        _load(ckpt, layers=3, opt=None)
    assert "layers.2.gate" in str(err.value) and "in the checkpoint but not in the model: none" in str(err.value)


def test_unexpected_parameters_are_listed(tmp_path):
    model, opt = _tiny(layers=3)
    zs.save_checkpoint(tmp_path / "big", model, opt)
    with pytest.raises(zs.CheckpointError, match=r"in the checkpoint but not in the model: \['layers.2.fc1.bias'"):
        _load(tmp_path / "big", layers=2)


def test_strict_false_loads_the_rest_with_a_warning(ckpt):
    model, opt = _tiny(layers=3)
    with pytest.warns(UserWarning, match="layers.2.fc1.weight"):
        zs.load_checkpoint(ckpt, model, None, strict=False)
    small, _ = _tiny()
    zs.load_checkpoint(ckpt, small, None)
    got, want = zs.full_state_dict(model), zs.full_state_dict(small)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_shape_mismatch(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(layers=2, dim=16)
    model, _ = zs.setup(model, None, zs.ZeroConfig(stage=2))
    zs.save_checkpoint(tmp_path / "c", model)
    with pytest.raises(zs.CheckpointError, match=r"shapes differ.*embed.weight: checkpoint \(37, 16\), model \(37, 24\)"):
        _load(tmp_path / "c", opt=None)


def test_optimizer_class_mismatch(ckpt):
    with pytest.raises(zs.CheckpointError, match="holds AdamW optimizer state but the optimizer is SGD"):
        _load(ckpt, optimizer="sgd")


def test_checkpoint_without_optimizer_state(tmp_path):
    model, _ = _tiny()
    zs.save_checkpoint(tmp_path / "w", model)
    with pytest.raises(zs.CheckpointError, match="saved without optimizer state; pass optimizer=None"):
        _load(tmp_path / "w")
    _load(tmp_path / "w", opt=None)
