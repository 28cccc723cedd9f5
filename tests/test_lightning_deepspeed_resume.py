"""Lightning's ``Trainer.fit(model, ckpt_path=...)`` on a directory Lightning's ``DeepSpeedStrategy``
saved, resumed through our strategies: weights, optimizer state, the loops and the LR scheduler go
on as DeepSpeed continues its own run. Lightning's DeepSpeedStrategy needs CUDA, so the directory is
made as it would make it: a real DeepSpeed engine's ``save_checkpoint`` with Lightning's checkpoint
dict as its client_state (tests/workers/lightning_deepspeed_resume.py). Slow tier; a module of its
own, so its runs go to another pytest worker than the other DeepSpeed runs.
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
def lightning_ds_runs(tmp_path_factory) -> dict[int, Path]:
    """Lightning DeepSpeedStrategy checkpoint directories of stage 2 and 3 (2 ranks), made as
    tests/workers/lightning_deepspeed_resume.py says, each with DeepSpeed's continued run."""
    root = tmp_path_factory.mktemp("lightning_deepspeed")
    cases = [dict(name=f"s{stage}", stage=stage, dir=str(root / f"s{stage}")) for stage in (2, 3)]
    deepspeed_runs_succeeded(launch("lightning_deepspeed_resume.py", 2, {"mode": "deepspeed", "cases": cases}, timeout=400),
                             "Lightning's DeepSpeedStrategy run")
    return {stage: root / f"s{stage}" for stage in (2, 3)}


@functools.lru_cache(maxsize=None)
def _lightning_resumed(world: int, dirs: tuple) -> tuple[dict, Path]:
    """Every directory resumed by ``Trainer(strategy="zero2"/"zero3").fit(ckpt_path=...)`` on ``world`` ranks."""
    out = Path(dirs[0][1]).parent / f"ours_w{world}"
    out.mkdir(exist_ok=True)
    cases = [dict(name=f"s{stage}-{preset}", strategy=preset, dir=d) for stage, d in dirs for preset in ("zero2", "zero3")]
    reports = launch("lightning_deepspeed_resume.py", world, {"mode": "ours", "cases": cases}, timeout=400, out=out)
    by_name = results_by_name(reports)
    return by_name, out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("preset", ["zero2", "zero3"])
@pytest.mark.parametrize("ds_stage", [2, 3])
def test_lightning_fit_resumes_a_deepspeed_strategy_checkpoint_as_deepspeed_continues(lightning_ds_runs, ds_stage,
                                                                                      preset, world):
    """``Trainer(strategy=preset).fit(module, ckpt_path=dir)`` on the directory Lightning's
    DeepSpeedStrategy saves (DeepSpeed's ZeRO files, Lightning's checkpoint dict as their
    client_state, tag ``checkpoint``): Lightning's loops resume at global step 3 and run to 6, the
    LR scheduler goes on from its saved state, and each continued loss and the final fp32 weights
    equal DeepSpeed continuing its own run (whose first 3 steps were those of an uninterrupted
    Lightning run: See the worker)."""
    by_name, out = _lightning_resumed(world, tuple(sorted((s, str(d)) for s, d in lightning_ds_runs.items())))
    name = f"s{ds_stage}-{preset}"
    results = finished_on_every_rank(by_name, name, world)
    ref = torch.load(lightning_ds_runs[ds_stage] / "reference.pt", weights_only=True)
    assert ref["client_state"]["global_step"] == 3
    for res in results:
        assert res["started"]["global_step"] == 3 and res["ended"]["global_step"] == 6
        assert res["losses"] == pytest.approx(ref["losses"], rel=FP32_TOL)
        assert res["lr"] == pytest.approx(ref["lr"], rel=1e-12)  # the scheduler went on from its saved state
    worst, where = worst_rel_diff(torch.load(out / f"{name}.pt", weights_only=True)["final"], ref["final"])
    assert worst < FP32_TOL, f"final weights differ from DeepSpeed's by {worst:.2e} ({where})"
