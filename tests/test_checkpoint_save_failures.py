"""A save that fails at any phase (a full disk above all) raises CheckpointError naming the
cause, leaves the previous checkpoint loadable and nothing else behind, so a retry works.

Before, a full disk while writing metadata.json left the temporary directory (38 MB in
the audit) beside the checkpoint, and the retry failed too.
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

import zero_strategy as zs
from zero_strategy.checkpoint import _safetensors_stream, _save
from _models import TinyLM, param_groups


def _tiny(seed=0, layers=2):
    torch.manual_seed(seed)
    model = TinyLM(layers=layers)
    return zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(stage=2))


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _fail_second_rename():
    calls = []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == 2:  # the old checkpoint is aside; the new one fails to move in
            _enospc()
        os.rename(src, dst)
    return rename


def _full_disk_at(name):
    """A StreamWriter constructor that finds the disk full when it creates the file ``name``."""
    original = _safetensors_stream.StreamWriter.__init__

    def init(self, path, *args, **kwargs):
        if os.path.basename(path) == name:
            _enospc()
        original(self, path, *args, **kwargs)
    return init


#: phase -> (object, attribute, replacement)
PHASES = {
    "rank_file": (_safetensors_stream.StreamWriter, "write", lambda *a, **k: _enospc()),
    "buffers": (_safetensors_stream.StreamWriter, "__init__", _full_disk_at("buffers.safetensors")),
    "extra_state": (_save.torch, "save", lambda *a, **k: _enospc()),
    "metadata": (_save, "_write_metadata", lambda *a, **k: _enospc()),
    "fsync": (_save, "_fsync_dir", lambda *a, **k: _enospc()),
    "rename": (_save, "_rename", None),
}


def _listing(path):
    return sorted(p.name for p in path.iterdir())


def _weights(model):
    return {k: v.clone() for k, v in zs.full_state_dict(model).items()}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_failure_at_each_phase_keeps_the_previous_checkpoint_and_nothing_else(tmp_path, monkeypatch, phase,
                                                                              async_save):
    """An asynchronous save raises the same error at the latest when it is waited for."""
    old_model, old_opt = _tiny(seed=1)
    zs.save_checkpoint(tmp_path / "ckpt", old_model, old_opt, extra_state={"n": 1})
    model, opt = _tiny(seed=2)
    target, attr, replacement = PHASES[phase]
    monkeypatch.setattr(target, attr, replacement or _fail_second_rename())
    with pytest.raises(zs.CheckpointError, match=r"No space left on device"):
        zs.save_checkpoint(tmp_path / "ckpt", model, opt, extra_state={"t": torch.ones(2)}, async_save=async_save)
        zs.checkpoint.wait_for_save(model)
    monkeypatch.undo()
    assert _listing(tmp_path) == ["ckpt"]
    assert _listing(tmp_path / "ckpt") == ["buffers.safetensors", "metadata.json", "rank00000-of-00001.safetensors"]
    check, check_opt = _tiny(seed=3)
    assert zs.load_checkpoint(tmp_path / "ckpt", check, check_opt) == {"n": 1}
    assert all(torch.equal(v, _weights(old_model)[k]) for k, v in _weights(check).items())
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)  # the retry starts clean and succeeds
    assert _listing(tmp_path) == ["ckpt"]


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root; test_failure_at_each_phase injects ENOSPC instead")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_disk_keeps_the_previous_checkpoint_and_the_retry_works(small_disk):
    small, small_opt = _tiny(seed=1)
    zs.save_checkpoint(small_disk / "ckpt", small, small_opt)
    big, big_opt = _tiny(seed=2, layers=12)  # ~10x the bytes of the first checkpoint
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * (free - 64 * 1024))  # 64 KiB left: less than the new rank file
    with pytest.raises(zs.CheckpointError, match=r"could not write its checkpoint file .*No space left on device"):
        zs.save_checkpoint(small_disk / "ckpt", big, big_opt)
    assert _listing(small_disk) == ["ckpt", "filler"]
    check, check_opt = _tiny(seed=3)
    zs.load_checkpoint(small_disk / "ckpt", check, check_opt)
    assert all(torch.equal(v, _weights(small)[k]) for k, v in _weights(check).items())
    filler.unlink()
    zs.save_checkpoint(small_disk / "ckpt", big, big_opt)
    assert _listing(small_disk) == ["ckpt"]
