"""DeepSpeed runs whose optimizer state (and parameters) were offloaded to NVMe, resumed here: real
DeepSpeed 0.19.8 runs (CPU, gloo, 2 ranks) with ``offload_optimizer`` on NVMe at stages 2 and 3 and a
stage-3 run with ``offload_param`` there too save after 3 steps and train on to 6; zero_strategy
resumes each at zero2 and zero3 on 1 and 2 ranks, as tests/test_deepspeed_checkpoint_import.py
resumes the others, and must equal DeepSpeed continuing its own run. The stage-3 runs' swapped
sub-group is read from the swap files DeepSpeed copies into the checkpoint, and a copy that lacks
one is refused naming it.

Slow tier, and only where DeepSpeed's aio op can be built (libaio-dev): it is built on first use,
minutes of both cores once per environment (DeepSpeed 0.19.8's prebuilt CPU aio op does not load, so
`.ci/run` cannot build it at install as it does CPUAdam's). A module of its own, so its runs go to another pytest worker than the
other DeepSpeed runs.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

from _compare import worst_rel_diff
from _deepspeed_import import (FP32_TOL, deepspeed_runs_succeeded, finished_on_every_rank, results_by_name, same,
                              setup_tiny, snapshot)
from _launch import launch

pytest.importorskip("deepspeed")

pytestmark = pytest.mark.multiprocess

#: DeepSpeed runs with NVMe offload: (name, stage, offload, vocab). DeepSpeed swaps a stage-3 sub-group
#: to NVMe only where a rank's part of it reaches 1 MiB, so the stage-3 runs' embedding is made that
#: large (vocab 24576: 294912 fp32 elements a rank); their small second group stays in memory, so a
#: checkpoint holds both kinds. Stage 2 has no swapper (NVMe means CPU memory there).
NVME_RUNS = [("s2_nvme", 2, "nvme-optimizer", 37), ("s3_nvme", 3, "nvme-optimizer", 24576),
             ("s3_nvme_param", 3, "nvme-optimizer+param", 24576)]
NVME_VOCAB = {n: v for n, _, _, v in NVME_RUNS}


@pytest.fixture(scope="module")
def nvme_runs(tmp_path_factory) -> dict[str, Path]:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible():  # DeepSpeed's NVMe swapper needs its aio op (libaio)
        pytest.skip("DeepSpeed's async_io op cannot be built here (libaio-dev missing)")
    root = tmp_path_factory.mktemp("deepspeed_nvme")
    cases = [dict(name=n, stage=s, bf16=False, offload=o, vocab=v, dir=str(root / n), nvme_path=str(root / f"swap_{n}"))
             for n, s, o, v in NVME_RUNS]
    for c in cases:
        Path(c["nvme_path"]).mkdir()
    # DeepSpeed's aio op is built on first use (minutes, once per environment): See [Note: DeepSpeed's
    # compiled ops in the tests] in workers/deepspeed_checkpoint.py
    reports = launch("deepspeed_checkpoint.py", 2, {"mode": "deepspeed", "cases": cases}, timeout=1200)
    deepspeed_runs_succeeded(reports, "DeepSpeed's own NVMe run")
    return {n: root / n for n, *_ in NVME_RUNS}


@functools.lru_cache(maxsize=None)
def _ours_nvme(world: int, dirs: tuple) -> tuple[dict, Path]:
    """Every NVMe run resumed at zero2 and zero3 on ``world`` ranks, in one launch."""
    out = Path(dirs[0][1]).parent / f"ours_w{world}"
    out.mkdir(exist_ok=True)
    cases = [dict(name=f"{name}-zero{stage}", stage=stage, precision="fp32", dir=d, vocab=NVME_VOCAB[name])
             for name, d in dirs for stage in (2, 3)]
    reports = launch("deepspeed_checkpoint.py", world, {"mode": "ours", "cases": cases}, timeout=300, out=out)
    by_name = results_by_name(reports)
    return by_name, out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_deepspeeds_stage3_nvme_checkpoints_keep_the_swapped_state_beside_the_rank_files(nvme_runs):
    """What the resume below reads (See [Note: NVMe-swapped sub-groups] in checkpoint/_deepspeed.py):
    the stage-3 runs' rank files hold the swapped sub-group empty, its elements in the tag's
    ``offloaded_tensors/rank<NN>/``; the stage-2 run's files are complete."""
    from zero_strategy.checkpoint._deepspeed import safe_load

    for name, stage, *_ in NVME_RUNS:
        tag = nvme_runs[name] / (nvme_runs[name] / "latest").read_text().strip()
        for rank in range(2):
            flat = safe_load(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
            groups = flat["fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"]
            if stage == 3:
                assert [t.numel() == 0 for t in groups] == [True, False], "the embedding's sub-group was not swapped"
                swapped = sorted(p.name for p in (tag / "offloaded_tensors" / f"rank{rank:02d}").iterdir())
                assert swapped == sorted(f"{k}{groups[0].ds_id}.tensor.swp" for k in ("", "exp_avg-", "exp_avg_sq-"))
            else:
                assert all(t.numel() > 0 for t in groups) and not (tag / "offloaded_tensors").exists()


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("run", [n for n, *_ in NVME_RUNS])
def test_resumes_an_nvme_offloaded_deepspeed_run_as_deepspeed_continues_it(nvme_runs, run, stage, world):
    """As the test above it for the other runs: the weights right after the load equal DeepSpeed's fp32
    masters at its save bit for bit, the frozen parameter comes over, the continued losses and the
    final weights equal DeepSpeed continuing its own run (fp32: FP32_TOL; measured 0 on 2 ranks)."""
    by_name, out = _ours_nvme(world, tuple(sorted((n, str(d)) for n, d in nvme_runs.items())))
    name = f"{run}-zero{stage}"
    results = finished_on_every_rank(by_name, name, world)
    ref = torch.load(nvme_runs[run] / "reference.pt", weights_only=True)
    ours = torch.load(out / f"{name}.pt", weights_only=True)
    for k, want in ref["at_save"].items():
        assert torch.equal(ours["at_load"][k], want), f"{k} after the load differs from DeepSpeed's fp32 master at its save"
    assert torch.equal(ours["at_load"]["frozen_mix"], ref["frozen"]), "the frozen parameter was not loaded"
    rel = [abs(a - b) / abs(b) for a, b in zip(results[0]["losses"], ref["losses"])]
    assert max(rel) < FP32_TOL, f"losses {results[0]['losses']} vs DeepSpeed's {ref['losses']}"
    worst, where = worst_rel_diff(ours["final"], ref["final"])
    assert worst < FP32_TOL, f"final weights differ from DeepSpeed's by {worst:.2e} ({where})"


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_an_nvme_checkpoint_copied_without_its_swap_files_is_refused_naming_them(nvme_runs, tmp_path):
    import zero_strategy as zs

    copy = tmp_path / "s3_nvme"
    shutil.copytree(nvme_runs["s3_nvme"], copy)
    tag = copy / (copy / "latest").read_text().strip()
    next((tag / "offloaded_tensors" / "rank01").glob("exp_avg_sq-*.tensor.swp")).unlink()
    model, zopt = setup_tiny()
    before = snapshot(model, zopt)
    with pytest.raises(zs.CheckpointError, match=r"rank01/exp_avg_sq-\d+_\d+\.tensor\.swp is missing: DeepSpeed swapped "
                       r"rank 1's exp_avg_sq of sub-group 0 to NVMe.*copy the checkpoint with that folder, or resume it "
                       r"in DeepSpeed and save it again with offload_optimizer.device 'cpu'"):
        zs.load_checkpoint(copy, model, zopt)
    assert same(before, snapshot(model, zopt))
