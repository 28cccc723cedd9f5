"""``zero-strategy estimate --this-machine``: the ranks' needs set beside a machine's memory and
disks, with zero_auto's headroom on memory and none on disk, and every shortfall named."""

from __future__ import annotations

import json
import shutil

import pytest

from zero_strategy import cli
from zero_strategy._mechanisms.available_memory import HEADROOM
from zero_strategy.estimate import estimate_memory, fit_on_this_machine

GIB = 2**30


def nvme_setup(params: float = 1.7e9):
    return estimate_memory(params, world_size=2, stage=3, precision="bf16", offload_optimizer="nvme",
                           offload_params="nvme", device="cpu")


def test_memory_fits_up_to_the_headroom_zero_auto_keeps(tmp_path):
    est = nvme_setup()
    need = 2 * (est.total_device + est.peak_host)  # two ranks, one memory (no GPU); staging is known
    just_enough = int(need / (1 - HEADROOM)) + 1
    fit = fit_on_this_machine(est, 2, tmp_path, tmp_path, memory_available=just_enough, has_gpu=False)
    assert fit.memory_needed == need and fit.fits_memory
    short = fit_on_this_machine(est, 2, tmp_path, tmp_path, memory_available=just_enough - 2, has_gpu=False)
    assert not short.fits_memory and not short.fits
    assert any(s.startswith("memory:") for s in short.shortfalls())


def test_a_gpu_holds_the_device_share_and_host_memory_the_rest(tmp_path):
    est = estimate_memory(1e9, world_size=2, stage=3, precision="bf16", offload_optimizer="cpu")
    fit = fit_on_this_machine(est, 2, tmp_path, tmp_path, memory_available=10**15, gpu_free=GIB, has_gpu=True)
    assert fit.memory_needed == 2 * est.peak_host and fit.gpu_needed == est.total_device
    assert not fit.fits_memory and any(s.startswith("GPU memory") for s in fit.shortfalls())


def test_swap_files_checkpoint_and_export_share_one_disk(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    too_big = nvme_setup(params=free / 12 * 1.05)  # the checkpoint alone (12 bytes a parameter) overflows
    fit = fit_on_this_machine(too_big, 2, tmp_path / "nvme", tmp_path / "ckpt", memory_available=10**18,
                              has_gpu=False)
    assert fit.same_disk and fit.swap_disk == 2 * too_big.nvme_bytes
    assert fit.save_disk == too_big.checkpoint_bytes + too_big.export_bytes
    assert fit.fits_memory and not fit.fits_disk
    assert any(s.startswith("disk:") and "swap files, checkpoint, export" in s for s in fit.shortfalls())
    small = nvme_setup(params=1e6)
    assert fit_on_this_machine(small, 2, tmp_path / "nvme", tmp_path / "ckpt", memory_available=10**18,
                               has_gpu=False).fits


def test_the_command_reports_each_setup_on_this_machine(capsys, tmp_path):
    assert cli.main(["estimate", "--params", "1e6", "--world-size", "2", "--this-machine",
                     "--nvme-path", str(tmp_path / "nvme"), "--save-dir", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 8 and all(row["this_machine"]["fits"] for row in rows)
    nvme = next(r for r in rows if r["offload_optimizer"] == "nvme")
    assert nvme["this_machine"]["swap_disk"] == 2 * nvme["nvme_bytes"] > 0


def test_the_command_names_what_does_not_fit(capsys, tmp_path):
    assert cli.main(["estimate", "--params", "1e15", "--world-size", "2", "--stage", "3", "--offload-optimizer",
                     "nvme", "--offload-params", "nvme", "--this-machine", "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "this machine, 2 rank(s):" in out
    assert "does not fit: memory:" in out and "disk:" in out
