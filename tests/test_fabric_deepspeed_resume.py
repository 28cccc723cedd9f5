"""``fabric.load(path, state)`` with ``Fabric(strategy="zero2"/"zero3")`` on a directory Lightning
Fabric's ``DeepSpeedStrategy`` saved: the model, the optimizer and the rest of the state ("step",
an LR scheduler) come back, and training goes on as DeepSpeed continues its own run. Fabric's
DeepSpeedStrategy needs CUDA, so the directory is made as it would make it (a real DeepSpeed
engine's ``save_checkpoint`` with the rest of Fabric's state as its client_state:
tests/workers/fabric_deepspeed_resume.py). Slow tier; a module of its own, so its runs go to another
pytest worker than the other DeepSpeed runs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from _compare import worst_rel_diff
from _deepspeed_import import FP32_TOL, deepspeed_runs_succeeded, finished_on_every_rank, results_by_name
from _launch import launch

pytest.importorskip("deepspeed")
pytest.importorskip("lightning")

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def fabric_ds_runs(tmp_path_factory) -> dict[int, Path]:
    """Fabric DeepSpeedStrategy checkpoint directories of stage 2 and 3 (2 ranks), each with
    DeepSpeed's continued run."""
    root = tmp_path_factory.mktemp("fabric_deepspeed")
    cases = [dict(name=f"s{stage}", stage=stage, dir=str(root / f"s{stage}")) for stage in (2, 3)]
    deepspeed_runs_succeeded(launch("fabric_deepspeed_resume.py", 2, {"mode": "deepspeed", "cases": cases}, timeout=400),
                             "Fabric's DeepSpeedStrategy run")
    return {stage: root / f"s{stage}" for stage in (2, 3)}


@functools.lru_cache(maxsize=None)
def _fabric_loaded(world: int, dirs: tuple) -> tuple[dict, Path]:
    """Every directory loaded by ``fabric.load`` under ``Fabric(strategy="zero2"/"zero3")`` on ``world`` ranks."""
    out = Path(dirs[0][1]).parent / f"ours_w{world}"
    out.mkdir(exist_ok=True)
    cases = [dict(name=f"s{stage}-{preset}", strategy=preset, dir=d) for stage, d in dirs for preset in ("zero2", "zero3")]
    reports = launch("fabric_deepspeed_resume.py", world, {"mode": "ours", "cases": cases}, timeout=400, out=out)
    return results_by_name(reports), out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("preset", ["zero2", "zero3"])
@pytest.mark.parametrize("ds_stage", [2, 3])
def test_fabric_load_of_a_deepspeed_strategy_checkpoint_goes_on_as_deepspeed(fabric_ds_runs, ds_stage, preset,
                                                                                world):
    """``state = {"model": model, "optimizer": optimizer, "step": 0, "scheduler": scheduler};
    fabric.load(dir, state)``: ``state["step"]`` is the saved 3, the scheduler goes on from its saved
    state, nothing of the client_state is left over, and each continued loss and the final fp32
    weights equal DeepSpeed continuing its own run."""
    by_name, out = _fabric_loaded(world, tuple(sorted((s, str(d)) for s, d in fabric_ds_runs.items())))
    name = f"s{ds_stage}-{preset}"
    results = finished_on_every_rank(by_name, name, world)
    ref = torch.load(fabric_ds_runs[ds_stage] / "reference.pt", weights_only=True)
    for res in results:
        assert res["step"] == 3 and res["remainder"] == []
        assert res["losses"] == pytest.approx(ref["losses"], rel=FP32_TOL)
        assert res["lr"] == pytest.approx(ref["lr"], rel=1e-12)  # the scheduler went on from its saved state
    worst, where = worst_rel_diff(torch.load(out / f"{name}.pt", weights_only=True)["final"], ref["final"])
    assert worst < FP32_TOL, f"final weights differ from DeepSpeed's by {worst:.2e} ({where})"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fabric_load_refuses_a_key_the_client_state_lacks_and_changes_nothing(fabric_ds_runs, tmp_path):
    """strict: a key of ``state`` DeepSpeed's client_state lacks is Fabric's KeyError, raised before
    anything of the checkpoint is copied, on every rank."""
    cases = [dict(name="absent", strategy="zero3", dir=str(fabric_ds_runs[3]), absent=True)]
    reports = launch("fabric_deepspeed_resume.py", 2, {"mode": "ours", "cases": cases}, timeout=400, out=tmp_path)
    results = results_by_name(reports)["absent"]
    assert len(results) == 2
    for res in results:
        assert "error" not in res, res["error"]
        assert res["raised"] == ("KeyError: \"The requested state contains a key 'absent' that does not exist in the "
                                 "loaded checkpoint. To disable strict loading, set `strict=False`.\"")
        assert res["changed"] == [] and res["step"] == 0
