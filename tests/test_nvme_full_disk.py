"""A full disk under NVMe offload is an NVMeError naming the swap file and the free space,
within seconds, on the rank that hit it; the others leave through their failed
collective; nothing waits forever. (Before: 8 of 10 configurations hung.)

The disks are real where the tests run as root (a tmpfs mounted for the test); the
"later step" cases inject ENOSPC into the swapper's writes, which is what a
filesystem whose fallocate does not guarantee space (CoW, thin provisioning, quotas)
does after the up-front reservation succeeded.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest
import torch

import zero_strategy as zs
import zero_strategy._mechanisms.nvme as nvme
import zero_strategy._mechanisms.swap_file as swap_file
import zero_strategy._engine.placement as placement
from _launch import launch
from _models import TinyLM, batch, loss_fn, param_groups

#: setup writes 86 KiB of swap for this model, the first step 168 KiB
SMALL_DISK = "128k"


def nvme_config(path):
    nv = {"device": "nvme", "path": str(path), "buffer_size": 16384}
    return zs.ZeroConfig(stage=3, param_persistence_threshold=0, offload_optimizer=nv, offload_params=nv)


def make(path):
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    return zs.setup(model, torch.optim.AdamW(param_groups(model)), nvme_config(path))


def train_step(model, zopt, step=0):
    tokens, targets = batch(0, step, 0)
    loss_fn(model(tokens), targets).backward()
    zopt.step()
    zopt.zero_grad()


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of SMALL_DISK bytes (tmpfs); skipped where mounting is not permitted."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK}", "tmpfs",
                                            str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root; the ENOSPC-injection tests cover the same paths")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _assert_store_released(model):
    """The store is marked failed and every staging slot is back in the pool."""
    swap = zs.api._engine_of(model).swap
    assert swap._failed is not None
    assert len(swap.pool._free) == swap.pool.count


def test_disk_too_small_is_refused_at_setup_with_the_numbers(small_disk):
    with pytest.raises(nvme.NVMeError, match=r"disk.* has 0\.00 GiB free but this rank's swap file needs "
                                             r"0\.06 GiB; free space or choose another disk"):
        make(small_disk)
    assert os.listdir(small_disk) == []  # nothing left on the full disk


def test_reservation_on_a_full_disk_names_file_and_free_space(small_disk):
    files = nvme.SwapFile(small_disk, rank=0, io_threads=1, chunk_bytes=4096)
    with pytest.raises(nvme.NVMeError, match=r"cannot reserve 0\.00 GiB for the NVMe swap file .*disk/zero_swap-"
                                             r"local-r0-[0-9a-f]{16}/swap\.bin: the disk is full \(0\.00 GiB free "
                                             r"there\)"):
        files.region("big", 1 << 20)
    files.close()
    assert os.listdir(small_disk) == []


def test_real_full_disk_at_the_first_step_raises_within_seconds(small_disk, monkeypatch):
    monkeypatch.setattr(placement, "swap_bytes", lambda *a, **k: 0)  # no reservation: the step grows the file
    model, zopt = make(small_disk)
    t0 = time.monotonic()
    with pytest.raises(nvme.NVMeError, match=r"cannot reserve .* swap file .*swap\.bin: the disk is full "
                                             r"\(0\.00 GiB free there\)"):
        train_step(model, zopt)
    assert time.monotonic() - t0 < 10
    _assert_store_released(model)
    with pytest.raises(nvme.NVMeError, match="an earlier NVMe operation on .* failed .* not read back"):
        train_step(model, zopt, 1)  # refuses at once instead of reading stale state or waiting
    zs.teardown(model, keep_weights=False)
    assert os.listdir(small_disk) == []


@pytest.mark.parametrize("step", [0, 2], ids=["first_step", "later_step"])
def test_write_failure_raises_within_seconds_and_returns_its_slot(tmp_path, monkeypatch, step):
    model, zopt = make(tmp_path)
    for s in range(step):
        train_step(model, zopt, s)
    monkeypatch.setattr(swap_file.os, "pwrite", _enospc)
    t0 = time.monotonic()
    with pytest.raises(nvme.NVMeError, match=r"write to .*swap\.bin at byte \d+ failed: disk full "
                                             r"\(\d+\.\d\d GiB free there\)"):
        train_step(model, zopt, step)
    assert time.monotonic() - t0 < 10
    _assert_store_released(model)
    monkeypatch.undo()
    with pytest.raises(nvme.NVMeError, match="an earlier NVMe operation .* failed"):
        train_step(model, zopt, step + 1)
    zs.teardown(model, keep_weights=False)
    assert os.listdir(tmp_path) == []


def test_slot_wait_gives_up_with_a_message(monkeypatch):
    monkeypatch.setattr(nvme, "SLOT_TIMEOUT_S", 0.2)
    pool = nvme.SlotPool(1, pin=False)
    pool.acquire(4096)
    t0 = time.monotonic()
    with pytest.raises(nvme.NVMeError, match=r"no NVMe staging buffer came free in 0 s \(all 1 held\)"):
        pool.acquire(4096)
    assert time.monotonic() - t0 < 5


def _two_ranks(tmp_path, fail_rank, fault, at=0, paths=None):
    paths = paths or [str(tmp_path / f"swap{r}") for r in range(2)]
    t0 = time.monotonic()
    reports = launch("nvme_faults.py", 2, {"paths": paths, "fail_rank": fail_rank, "fault": fault, "at": at,
                                           "steps": 4}, timeout=80)
    return reports, time.monotonic() - t0


def _assert_every_rank_failed(reports, fail_rank, message):
    failed = reports[fail_rank]
    assert failed.get("type") == "NVMeError", failed
    assert __import__("re").search(message, failed["error"]), failed["error"]
    assert failed["seconds"] < 10
    other = reports[1 - fail_rank]
    assert "error" in other, f"rank {1 - fail_rank} finished training although rank {fail_rank} failed: {other}"


@pytest.mark.multiprocess
def test_two_ranks_real_full_disk_at_the_first_step(tmp_path, small_disk):
    reports, _ = _two_ranks(tmp_path, 0, "reserve", paths=[str(small_disk), str(tmp_path / "swap1")])
    assert reports[0]["steps_done"] == 0
    _assert_every_rank_failed(reports, 0, r"the disk is full \(0\.00 GiB free there\)")


@pytest.mark.multiprocess
def test_two_ranks_write_failure_at_the_first_step(tmp_path):
    reports, _ = _two_ranks(tmp_path, 0, "enospc", at=0)
    assert reports[0]["steps_done"] == 0
    _assert_every_rank_failed(reports, 0, r"write to .*swap\.bin at byte \d+ failed: disk full")


@pytest.mark.multiprocess
def test_two_ranks_write_failure_at_a_later_step(tmp_path):
    reports, _ = _two_ranks(tmp_path, 1, "enospc", at=2)
    assert reports[1]["steps_done"] == 2
    _assert_every_rank_failed(reports, 1, r"write to .*swap\.bin at byte \d+ failed: disk full")
