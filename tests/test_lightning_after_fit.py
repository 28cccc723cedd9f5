"""After ``trainer.fit(model)``: save, validate, test, predict, fit again and resume, as with DDP.

The same Lightning script (tests/workers/lightning_after_fit.py) runs on 2 gloo ranks with
``strategy="ddp"`` and with ZeRO stages 2 and 3; every metric, prediction, loss and final
weight must equal DDP's. The engine stays alive after fit (see [Note: engine lifetime] in
src/zero_strategy/lightning/_strategy.py) until ``trainer.strategy.teardown()``.
"""

from __future__ import annotations

import pytest
import torch

from _launch import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STRATEGIES = {
    "ddp": "ddp",
    "zero2": "zero2",
    "zero3": {"stage": 3, "param_persistence_threshold": 0},  # every parameter sharded
}
ZERO = ["zero2", "zero3"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("after_fit")
    cases = [dict(name=n, strategy=s, save_dir=str(save_dir)) for n, s in STRATEGIES.items()]
    cases += [dict(name=f"{n}_bf16", strategy=STRATEGIES[n], precision="bf16-mixed", save_dir=str(save_dir))
              for n in ("ddp", "zero2")]
    reports = launch("lightning_after_fit.py", 2, {"cases": cases}, timeout=420)
    for r in reports:
        for name, rep in r.items():
            assert "error" not in rep, f"{name}: {rep['error']}\n{rep.get('trace', '')}"
    return reports, save_dir


def _assert_weights_equal(save_dir, name: str, step: str, rtol: float = 1e-5):
    got, want = torch.load(save_dir / f"{name}-{step}.pt"), torch.load(save_dir / f"ddp-{step}.pt")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=1e-6, msg=lambda m, k=k: f"{step} {k}: {m}")


def _metrics(results: list[dict]) -> dict:
    """The logged metrics of ``trainer.validate``/``test``'s results; an empty result compares nothing, so it fails."""
    metrics = {k: v for d in results for k, v in d.items()}
    assert metrics, f"no metric logged: {results!r}"
    return metrics


@pytest.mark.parametrize("name", ZERO)
def test_validate_test_predict_after_fit_match_ddp(run, name):
    reports, save_dir = run
    for r in reports:
        ours, ddp = r[name], r["ddp"]
        assert ours["fit_losses"] == pytest.approx(ddp["fit_losses"], rel=1e-5)
        assert _metrics(ours["validate"]) == pytest.approx(_metrics(ddp["validate"]), rel=1e-5)
        assert _metrics(ours["test"]) == pytest.approx(_metrics(ddp["test"]), rel=1e-5)
        torch.testing.assert_close(torch.tensor(ours["predict"]), torch.tensor(ddp["predict"]), rtol=1e-5, atol=1e-6)
    _assert_weights_equal(save_dir, name, "fit")


@pytest.mark.parametrize("name", ZERO)
def test_second_fit_continues_like_ddp(run, name):
    reports, save_dir = run
    for r in reports:
        assert r[name]["second_fit_step"] == r["ddp"]["second_fit_step"] > 0
        assert r[name]["second_fit_losses"] == pytest.approx(r["ddp"]["second_fit_losses"], rel=1e-5)
        assert r[name]["second_fit_losses"]  # it trained
    _assert_weights_equal(save_dir, name, "second_fit")


@pytest.mark.parametrize("name", ZERO)
def test_checkpoint_saved_after_fit_resumes_and_loads_like_ddp(run, name):
    reports, save_dir = run
    assert (save_dir / f"{name}-final.ckpt" / "metadata.json").is_file()  # sharded, with optimizer state
    for r in reports:
        assert r[name]["resumed_step"] == r["ddp"]["resumed_step"]
        assert r[name]["resumed_losses"] == pytest.approx(r["ddp"]["resumed_losses"], rel=1e-5)
        assert _metrics(r[name]["validate_ckpt"]) == pytest.approx(_metrics(r[name]["validate"]), rel=1e-6)
        assert _metrics(r[name]["validate_ckpt"]) == pytest.approx(_metrics(r["ddp"]["validate_ckpt"]), rel=1e-5)
    _assert_weights_equal(save_dir, name, "resumed")


@pytest.mark.parametrize("name", ZERO)
def test_strategy_teardown_releases_the_engine(run, name):
    reports, save_dir = run
    assert not any(r[name]["set_up_after_release"] for r in reports)
    assert not any(r[name]["set_up_after_other_module"] for r in reports)
    _assert_weights_equal(save_dir, name, "released")


def test_released_weights_after_bf16_mixed_are_the_fp32_masters(run):
    """DDP's module stays fp32 under bf16-mixed (autocast); ours comes back fp32 from the masters, not rounded."""
    reports, save_dir = run
    for r in reports:
        assert r["ddp_bf16"]["dtypes_after_release"] == r["zero2_bf16"]["dtypes_after_release"] == ["torch.float32"]
    released, masters = torch.load(save_dir / "zero2_bf16-released.pt"), torch.load(save_dir / "zero2_bf16-masters.pt")
    trained = [k for k in masters if k != "model.frozen_mix"]  # a frozen parameter has no fp32 master
    assert trained
    for k in trained:
        torch.testing.assert_close(released[k], masters[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
