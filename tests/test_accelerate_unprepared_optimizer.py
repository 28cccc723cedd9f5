"""An optimizer that was never passed to ``accelerator.prepare``: loud under ZeroAccelerator, never silent.

Stock Accelerate wraps a model prepared alone in DDP, so the script below (the quick
tour's loop, optimizer left out of ``prepare``) still trains identical replicas. Under
ZeroAccelerator the model waits for its optimizer to be sharded with it; before this
was guarded, the ranks silently drifted apart (1.14 apart). ZeroAccelerator now
refuses the first backward with the fix (see [Note: a model whose optimizer was never
prepared]), and the fixed script trains exactly as the stock DDP run did. Oracle: the
stock ``accelerate.Accelerator`` (DDP) on the same 2 CPU processes, same data and seed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

from _accelerate_launch import accelerate_launch  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def reports():
    reports, log = accelerate_launch("accelerate_unprepared_optimizer.py", {})
    assert all(r["num_processes"] == 2 for r in reports), log[-3000:]
    return reports


def test_stock_accelerate_keeps_replicas_identical(reports):
    """The reference behaviour: DDP averages the gradients the unprepared optimizer steps on."""
    a, b = (r["stock"]["weights"] for r in reports)
    assert a is not None and a == pytest.approx(b, abs=1e-6)


@pytest.mark.parametrize("case", ["zero_unprepared", "zero_plain_backward"])
def test_zero_accelerator_refuses_the_first_backward_with_the_fix(reports, case):
    for r in reports:
        res = r[case]
        assert res["error"] == "RuntimeError", res
        assert "prepared without its optimizer" in res["message"]
        assert "accelerator.prepare(model, optimizer)" in res["message"]


@pytest.mark.parametrize("case", ["zero_fixed", "zero_late"])
def test_the_fixed_script_trains_as_stock_ddp(reports, case):
    """Optimizer prepared with the model, or prepared after it (the guard is lifted when it is sharded)."""
    stock = reports[0]["stock"]["weights"]
    for r in reports:
        assert r[case]["error"] is None, r[case]
        assert r[case]["weights"] == pytest.approx(stock, rel=1e-5, abs=1e-6)


def test_the_runs_really_trained(reports):
    """The comparisons above mean something only if training moved the weights away from the start."""
    init = reports[0]["initial"]
    for case in ("stock", "zero_fixed"):
        moved = max(abs(a - b) for a, b in zip(reports[0][case]["weights"], init))
        assert moved > 1e-3, f"{case}: weights moved only {moved:.2e}"


def test_a_model_prepared_alone_may_still_run_forward(reports):
    for r in reports:
        assert r["zero_forward_only"]["error"] is None, r["zero_forward_only"]
