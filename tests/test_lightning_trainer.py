"""Trainer(strategy=<preset>) against strategy="ddp" on the same module and data (2 gloo ranks).

All scenarios of one world size run in one worker start (a 2-rank Trainer.fit costs
seconds here); each test reads its scenario's report and final weights.
"""

from __future__ import annotations

import pytest
import torch

from _launch import launch

pytestmark = pytest.mark.multiprocess

PRESETS = ["zero1", "zero2", "zero3", "zero2_offload", "zero3_offload"]


def _cases(save_dir: str) -> list[dict]:
    cases = [dict(name="ddp", strategy="ddp")]
    cases += [dict(name=p, strategy=p) for p in PRESETS]
    cases += [
        dict(name="nvme", strategy="zero3_offload_nvme", epochs=1),
        dict(name="ddp_clip_acc", strategy="ddp", clip=0.05, accumulate=2, batch=2),
        dict(name="zero2_clip_acc", strategy="zero2", clip=0.05, accumulate=2, batch=2),
        dict(name="zero3_clip_acc", strategy={"stage": 3, "param_persistence_threshold": 0}, clip=0.05,
             accumulate=2, batch=2, summary=True),
        dict(name="zero3_bf16", strategy="zero3", precision="bf16-mixed"),
        dict(name="gan_ddp", strategy="ddp_find_unused_parameters_true", module="gan"),
        dict(name="gan_zero2", strategy="zero2", module="gan"),
        dict(name="gan_zero3", strategy={"stage": 3, "unit_classes": ["Generator", "Discriminator"],
                                         "param_persistence_threshold": 0}, module="gan"),
        dict(name="muon_ddp", strategy="ddp", module="muon"),
        dict(name="muon_zero2", strategy="zero2", module="muon"),
        dict(name="muon_zero3", strategy={"stage": 3, "param_persistence_threshold": 0}, module="muon"),
        dict(name="swa", strategy="zero2", callbacks="swa", epochs=1),
        dict(name="meta_ddp", strategy="ddp", module="meta", every_rank_saves=True),
        dict(name="meta_zero3", strategy="zero3", module="meta", summary=True, every_rank_saves=True),
    ]
    for c in cases:
        c["save_dir"] = save_dir
    return cases


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("lightning_trainer")
    reports = launch("lightning_trainer.py", 2, {"cases": _cases(str(save_dir))}, timeout=280)
    return reports, save_dir


def _ok(reports, name):
    for r in reports:
        assert "error" not in r[name], f"{name}: {r[name]['error']}\n{r[name].get('trace', '')}"
    return reports


def _weights(save_dir, name):
    return torch.load(save_dir / f"{name}.pt")


def _assert_close(a: dict, b: dict, rtol: float, atol: float = 1e-7):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_fit_matches_ddp(run, preset):
    reports, save_dir = run
    _ok(reports, "ddp")
    _ok(reports, preset)
    for r in reports:
        assert r[preset]["global_step"] == r["ddp"]["global_step"] == 4
        assert r[preset]["losses"] == pytest.approx(r["ddp"]["losses"], rel=1e-5)
    _assert_close(_weights(save_dir, preset), _weights(save_dir, "ddp"), rtol=1e-5)


def test_nvme_preset_fit_matches_ddp(run):
    """zero3_offload_nvme for one epoch: the losses of DDP's first epoch."""
    reports, save_dir = run
    _ok(reports, "nvme")
    for r in reports:
        assert len(r["nvme"]["losses"]) == 2
        assert r["nvme"]["losses"] == pytest.approx(r["ddp"]["losses"][:2], rel=1e-5)


@pytest.mark.parametrize("name", ["zero2_clip_acc", "zero3_clip_acc"])
def test_norm_clipping_and_accumulation_match_ddp(run, name):
    reports, save_dir = run
    _ok(reports, "ddp_clip_acc")
    _ok(reports, name)
    _assert_close(_weights(save_dir, name), _weights(save_dir, "ddp_clip_acc"), rtol=1e-5)
    # clipping changed the result (0.05 is far below the gradient norms here)
    assert not torch.allclose(_weights(save_dir, "ddp_clip_acc")["model.embed.weight"],
                              _weights(save_dir, "ddp")["model.embed.weight"])


def test_model_summary_counts_unsharded_parameters(run):
    reports, _ = run
    _ok(reports, "zero3_clip_acc")
    from _models import TinyLM

    model = TinyLM(layers=2)
    total = sum(p.numel() for p in model.parameters())  # tied weight counted once, like Lightning
    for r in reports:
        s = r["zero3_clip_acc"]["summary"]
        assert s["total"] == total
        assert s["trainable"] == total - model.frozen_mix.numel()
        assert s["layers"]["model"] == total


def test_bf16_mixed_trains_close_to_fp32(run):
    reports, save_dir = run
    _ok(reports, "zero3_bf16")
    for r in reports:
        assert r["zero3_bf16"]["losses"] == pytest.approx(r["ddp"]["losses"], rel=5e-2)
    bf16 = _weights(save_dir, "zero3_bf16")
    assert bf16["model.embed.weight"].dtype == torch.float32  # reported as float
    _assert_close(bf16, _weights(save_dir, "ddp"), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("name", ["gan_zero2", "gan_zero3"])
def test_two_optimizer_manual_optimization_matches_ddp(run, name):
    reports, save_dir = run
    _ok(reports, "gan_ddp")
    _ok(reports, name)
    for r in reports:
        assert r[name]["losses"] == pytest.approx(r["gan_ddp"]["losses"], rel=1e-5)
    _assert_close(_weights(save_dir, name), _weights(save_dir, "gan_ddp"), rtol=1e-5)


@pytest.mark.parametrize("name", ["muon_zero2", "muon_zero3"])
def test_configure_optimizers_returning_muon_and_adamw_matches_ddp(run, name):
    """Muon's parameters are owned whole by one rank each (tests/test_owned_optimizers.py); both
    reduce the same gradients as DDP, so even Muon's bf16 Newton-Schulz sees the same input."""
    reports, save_dir = run
    _ok(reports, "muon_ddp")
    _ok(reports, name)
    for r in reports:
        assert r[name]["losses"] == pytest.approx(r["muon_ddp"]["losses"], rel=1e-5)
    _assert_close(_weights(save_dir, name), _weights(save_dir, "muon_ddp"), rtol=1e-5)


def test_swa_is_refused_clearly(run):
    reports, _ = run
    for r in reports:
        assert "StochasticWeightAveraging cannot be used with ZeroStrategy" in r["swa"]["error"]


def test_configure_model_on_meta_under_stage_3_trains_like_ddp(run):
    """The module built in configure_model (on meta under stage 3, materialized by setup) against
    Lightning DDP training the same module on the same data: each module initializes from its own
    seed (see LitMeta), so both start from rank 0's values only if setup broadcast them."""
    reports, save_dir = run
    _ok(reports, "meta_ddp")
    _ok(reports, "meta_zero3")
    for r in reports:
        zero, ddp = r["meta_zero3"], r["meta_ddp"]
        assert zero["built_on_meta"] is True and ddp["built_on_meta"] is False
        assert zero["global_step"] == ddp["global_step"] == 4
        assert zero["losses"] == pytest.approx(ddp["losses"], rel=1e-5)
    _assert_close(_weights(save_dir, "meta_zero3.rank0"), _weights(save_dir, "meta_ddp.rank0"), rtol=1e-5)


def test_ranks_agree_on_the_weights_of_a_model_built_on_meta(run):
    reports, save_dir = run
    _ok(reports, "meta_zero3")
    ranks = [_weights(save_dir, f"meta_zero3.rank{k}") for k in range(len(reports))]
    for k, weights in enumerate(ranks[1:], start=1):
        assert weights.keys() == ranks[0].keys()
        for name, w in weights.items():
            assert torch.equal(w, ranks[0][name]), f"rank {k} differs from rank 0 in {name}"


def test_model_summary_counts_a_model_built_on_meta(run):
    reports, _ = run
    _ok(reports, "meta_zero3")
    widths = (16, 32, 32, 16)
    total = 37 * 16 + sum(a * b + b for a, b in zip(widths, widths[1:])) + 16 * 37 + 37
    for r in reports:
        assert r["meta_zero3"]["summary"]["total"] == total
