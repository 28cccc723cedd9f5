"""NVMe offload checks its path before training, keeps its swap files only while it
runs, never reads a crashed run's files, and turns I/O failures into clear errors.

(Ownership, locks and symlinks: test_nvme_swap_ownership.py; full disks:
test_nvme_full_disk.py.)"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections import namedtuple

import pytest
import torch

import zero_strategy as zs
import zero_strategy._mechanisms.nvme as nvme
import zero_strategy._mechanisms.swap_file as swap_file
import zero_strategy._mechanisms.nvme_files as nvme_files
from _models import TinyLM, batch, loss_fn, param_groups


def nvme_config(path, **kw):
    return zs.ZeroConfig(stage=3, param_persistence_threshold=0,
                         offload_optimizer={"device": "nvme", "path": str(path), "buffer_size": 16384},
                         offload_params={"device": "nvme", "path": str(path), "buffer_size": 16384}, **kw)


def make(path, **kw):
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    return zs.setup(model, torch.optim.AdamW(param_groups(model)), nvme_config(path, **kw))


def train_step(model, zopt, step=0):
    tokens, targets = batch(0, step, 0)
    loss_fn(model(tokens), targets).backward()
    zopt.step()
    zopt.zero_grad()


def swap_files(path):
    """Every swap directory and the files in it, relative to ``path``."""
    return sorted(str(p.relative_to(path)) for p in path.glob("zero_swap*/**/*"))


def test_swap_file_exists_while_training_and_is_removed_at_teardown(tmp_path):
    model, zopt = make(tmp_path)
    train_step(model, zopt)
    files = swap_files(tmp_path)
    assert len(files) == 2 and all(re.fullmatch(r"zero_swap-local-r0-[0-9a-f]{16}/(lock|swap\.bin)", f)
                                   for f in files), files  # the lock file: See [Note: a lock that works on NFS]
    report = zs.memory_report(model)
    assert report.nvme_bytes > 0 and report.by_placement["host"]["optimizer_state"] == 0
    zs.teardown(model)
    assert swap_files(tmp_path) == [] and os.listdir(tmp_path) == []


def test_path_that_cannot_be_created_is_refused_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(nvme.NVMeError, match=r"cannot be created.*choose a directory"):
        make(blocker / "swap")


def test_unwritable_path_is_refused_before_training():
    with pytest.raises(nvme.NVMeError, match=r"/proc.*(not writable|cannot be created|cannot create)"):
        make("/proc/self")


def test_path_without_room_is_refused_with_the_numbers(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(nvme_files.shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 4096, 4096))
    with pytest.raises(nvme.NVMeError, match=r"0\.00 GiB free but this rank's swap file needs 0\.06 GiB"):
        make(tmp_path)
    assert swap_files(tmp_path) == []


def test_io_error_during_training_is_a_clear_error(tmp_path, monkeypatch):
    model, zopt = make(tmp_path)
    train_step(model, zopt)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swap_file.os, "pwrite", full_disk)
    with pytest.raises(nvme.NVMeError, match=r"write to .*zero_swap.*disk full \(\d+\.\d\d GiB free there\)"):
        train_step(model, zopt, step=1)


def test_checkpoint_from_an_nvme_run_resumes_in_a_plain_run(tmp_path):
    model, zopt = make(tmp_path / "swap")
    for step in range(2):
        train_step(model, zopt, step)
    zs.save_checkpoint(tmp_path / "ckpt", model, zopt)
    torch.manual_seed(0)
    plain = TinyLM(layers=2)
    plain, popt = zs.setup(plain, torch.optim.AdamW(param_groups(plain)), "zero2")
    zs.load_checkpoint(tmp_path / "ckpt", plain, popt)
    assert all(torch.equal(a, zs.full_state_dict(plain)[k]) for k, a in zs.full_state_dict(model).items())
    train_step(model, zopt, 2)
    train_step(plain, popt, 2)  # the optimizer state came along: the next step agrees too
    for k, a in zs.full_state_dict(model).items():
        torch.testing.assert_close(a, zs.full_state_dict(plain)[k], rtol=1e-6, atol=1e-7)
    # and back: the plain checkpoint loads into an NVMe run
    zs.save_checkpoint(tmp_path / "ckpt2", plain, popt)
    model2, zopt2 = make(tmp_path / "swap2")
    zs.load_checkpoint(tmp_path / "ckpt2", model2, zopt2)
    train_step(model2, zopt2, 3)
    train_step(plain, popt, 3)
    for k, a in zs.full_state_dict(model2).items():
        torch.testing.assert_close(a, zs.full_state_dict(plain)[k], rtol=1e-6, atol=1e-7)
    shutil.rmtree(tmp_path / "ckpt")
