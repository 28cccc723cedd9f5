"""Ranks that use different parameters, written the way Accelerate and Lightning users write
them, equal those libraries' own DDP with unused parameters allowed.

Issue #26. The oracles are what the libraries document for unused parameters: the stock
``accelerate.Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(
find_unused_parameters=True)])`` and ``Trainer(strategy="ddp_find_unused_parameters_true")``,
on the same 2 CPU processes, data and seed. Models: a tiny Hugging Face
``MixtralForCausalLM`` whose processes route their own tokens, and a LLaVA-style model
whose vision tower and projector run on one process's batches, and on a text-only step on
none (tests/workers/accelerate_routed.py, tests/workers/lightning_routed.py). Tolerance
1e-5 relative on every final weight (fp32 on both sides).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from _accelerate_launch import accelerate_launch  # noqa: E402
from _compare import tensor_rel_diff  # noqa: E402
from _launch import launch  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
TOL = 1e-5
ACCELERATE_CASES = [{"model": m, "preset": p} for m in ("mixtral", "vlm")
                    for p in ("zero1", "zero2", "zero3", "zero3_offload")]
LIGHTNING_PRESETS = ["zero2", "zero3", "zero3_offload"]


@pytest.fixture(scope="module")
def accelerate_reports():
    reports, _ = accelerate_launch("accelerate_routed.py", {}, timeout=400)
    return reports


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning_routed")
    strategies = ["ddp_find_unused_parameters_true", *LIGHTNING_PRESETS]
    reports = launch("lightning_routed.py", 2, {"strategies": strategies}, timeout=400, out=out)
    return out, reports


def test_the_stock_oracle_trained_the_parts_some_ranks_skip(accelerate_reports):
    moved = accelerate_reports[0]["stock_moved"]
    for name in ("mixtral:model.layers.0.mlp.experts.gate_up_proj", "vlm:projector.0.weight",
                 "vlm:vision_tower.patch_embed.weight"):
        assert moved[name] > 1e-4, (name, moved[name])


@pytest.mark.parametrize("case", ACCELERATE_CASES, ids=lambda c: f"{c['model']}-{c['preset']}")
def test_zero_accelerator_equals_stock_accelerate_with_find_unused_parameters(accelerate_reports, case):
    for rank, report in enumerate(accelerate_reports):
        res = next((r for r in report["zero"] if r["case"] == case), None)
        assert res is not None, f"rank {rank} never reached {case}: {report['zero'][-1]}"
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        assert res["weight_rel_diff"] <= TOL, (rank, res["worst"], res["weight_rel_diff"])


@pytest.mark.parametrize("preset", LIGHTNING_PRESETS)
def test_lightning_preset_equals_ddp_find_unused_parameters_true(lightning_run, preset):
    out, reports = lightning_run
    for rank, report in enumerate(reports):
        for name in ("ddp_find_unused_parameters_true", preset):
            assert "error" not in report["runs"][name], (rank, name, report["runs"][name])
            assert report["runs"][name]["global_step"] == 4
    ref = torch.load(out / "ddp_find_unused_parameters_true.pt")
    got = torch.load(out / f"{preset}.pt")
    for name, want in ref.items():
        diff = tensor_rel_diff(got[name], want)
        assert diff <= TOL, (name, diff)
