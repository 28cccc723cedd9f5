"""``accelerator.clip_grad_value_(model.parameters(), v)`` on a ZeRO model equals stock Accelerate's DDP run.

Value clipping is elementwise, so ZeroAccelerator clamps each rank's shard of the
reduced (averaged) gradient, which is what DDP's ``clip_grad_value_`` does to the full
averaged gradient. Oracle: the stock ``accelerate.Accelerator`` (DDP) with the same
loop, data and seed on the same 2 CPU processes, gradient accumulation 2, SGD (whose
step is the clipped gradient itself, so a wrong clamp shows directly). Tolerance 1e-5
relative. (The HF ``TrainingArguments`` has only norm clipping, ``max_grad_norm``.)
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

from _accelerate_launch import accelerate_launch  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(400)]
PRESETS = ["zero1", "zero2", "zero3", "zero2_offload"]


@pytest.fixture(scope="module")
def reports():
    reports, _ = accelerate_launch("accelerate_value_clipping.py", {})
    return reports


def test_the_clip_bites(reports):
    """Gradients larger than the bound exist, and clipping changes the trained weights."""
    r = reports[0]
    assert r["stock_largest_grad"] > 5 * r["clip"]
    moved = max(abs(a - b) for a, b in zip(r["stock"], r["stock_unclipped"]))
    assert moved > 1e-3


@pytest.mark.parametrize("preset", PRESETS)
def test_value_clipping_equals_stock_ddp(reports, preset):
    for r in reports:
        res = next(x for x in r["zero"] if x["preset"] == preset)
        assert "error" not in res, res.get("error")
        assert res["weights"] == pytest.approx(r["stock"], rel=1e-5, abs=1e-6)
