"""Module conversions and freezing on a set-up model behave as on a plain model, or end ZeRO
with the trained weights, or raise at once with the fix. See [Note: conversions on a set-up
model] in _model/conversions.py.

Issue #26: ``accelerator.unwrap_model(model).cpu()`` after training (Accelerate's own test
idiom) raised from inside ``Module._apply``. Oracles: stock Accelerate (DDP) with the same
loop, data and seed on the same 2 CPU processes (tests/workers/accelerate_conversions.py),
and the plain model in this process.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _models import TinyLM, batch, loss_fn

import zero_strategy as zs

TOL = 1e-6


def _max_diff(a: dict, b: dict) -> float:
    return max(max(abs(x - y) for x, y in zip(a[n], b[n])) for n in b)


# ------------------------------------------------------------------ Accelerate, 2 processes
@pytest.fixture(scope="module")
def accelerate_reports():
    pytest.importorskip("accelerate")
    from _accelerate_launch import accelerate_launch
    reports, _ = accelerate_launch("accelerate_conversions.py", {}, timeout=400)
    return reports


def _zero(report, preset):
    res = next(r for r in report["zero"] if r["preset"] == preset)
    assert "error" not in res, res["error"]
    return res


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset", ["zero1", "zero2", "zero3", "zero3_offload"])
def test_unwrap_model_cpu_after_training_has_the_trained_weights_of_stock_accelerate(accelerate_reports, preset):
    for report in accelerate_reports:
        res = _zero(report, preset)
        assert res["device"] == "cpu"
        assert _max_diff(res["after_cpu"], report["stock"]["after_cpu"]) <= TOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset", ["zero1", "zero2"])
def test_training_goes_on_exactly_where_cpu_changed_nothing(accelerate_reports, preset):
    for report in accelerate_reports:
        res = _zero(report, preset)
        assert "next_step_error" not in res, res["next_step_error"]
        assert _max_diff(res["next_step"], report["stock"]["next_step"]) <= TOL
        assert _max_diff(res["next_step"], res["after_cpu"]) > 1e-4  # the step did something


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset", ["zero3", "zero3_offload"])
def test_after_cpu_gathered_the_weights_the_optimizer_refuses_to_step(accelerate_reports, preset):
    for report in accelerate_reports:
        message = _zero(report, preset)["next_step_error"]
        assert "no longer set up" in message and "model.cpu()" in message and "set it up again" in message


# ------------------------------------------------------------------ one process
def _trained(stage: int, steps: int = 2, plain: bool = False):
    """A set-up TinyLM trained ``steps`` steps; ``plain``: a plain torch copy too, trained the
    same way (the reference)."""
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                          zs.ZeroConfig(stage=stage, param_persistence_threshold=0))
    pairs = [(model, opt), (reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1))]
    for step in range(steps):
        for m, o in pairs[:2 if plain else 1]:
            tokens, targets = batch(0, step, 0)
            loss_fn(m(tokens), targets).backward()
            o.step()
            o.zero_grad()
    return (model, opt, reference) if plain else (model, opt)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_half_gives_the_trained_weights_in_half_precision(stage):
    model, opt, plain = _trained(stage, plain=True)
    trained = zs.full_state_dict(model)
    assert model.half() is model
    for name, p in model.named_parameters():
        assert p.dtype == torch.float16 and torch.equal(p, trained[name].half()), name
    plain.half()  # the independent reference: the plain model trained the same way, then .half()
    for (name, p), (_, want) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.allclose(p.float(), want.float(), rtol=1e-3, atol=1e-4), name
    tokens, _ = batch(0, 9, 0)
    with torch.no_grad():  # a plain fp16 module now: it runs without the engine
        assert torch.isfinite(model.float()(tokens)).all()
    with pytest.raises(RuntimeError, match="no longer set up"):
        opt.step()


@pytest.mark.parametrize("stage", [1, 3])
def test_converting_a_submodule_raises_before_anything_changes_and_training_goes_on(stage):
    model, opt = _trained(stage)
    before = zs.full_state_dict(model)
    with pytest.raises(RuntimeError, match=r"cannot convert the submodule .* Convert the whole model"):
        model.layers[0].half()
    after = zs.full_state_dict(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    tokens, targets = batch(0, 5, 0)
    loss_fn(model(tokens), targets).backward()
    opt.step()  # still set up


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where .cuda() fails")
def test_a_conversion_torch_refuses_gathers_nothing_and_leaves_the_model_set_up():
    model, opt = _trained(3)
    with pytest.raises((RuntimeError, AssertionError), match="(?i)cuda"):
        model.cuda()
    assert zs.memory_report(model) is not None  # still set up: the engine answers
    tokens, targets = batch(0, 5, 0)
    loss_fn(model(tokens), targets).backward()
    opt.step()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_freezing_a_block_after_setup_trains_like_the_plain_model(stage):
    torch.manual_seed(0)
    plain = TinyLM()
    model = copy.deepcopy(plain)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                          zs.ZeroConfig(stage=stage, param_persistence_threshold=0))
    for step in range(4):
        if step == 2:  # freeze the first block: no gradient, so AdamW leaves it alone
            plain.layers[0].requires_grad_(False)
            model.layers[0].requires_grad_(False)
        for m, o in ((plain, plain_opt), (model, opt)):
            tokens, targets = batch(0, step, 0)
            loss_fn(m(tokens), targets).backward()
            o.step()
            o.zero_grad()
    full = zs.full_state_dict(model)
    for name, want in plain.state_dict().items():
        assert torch.allclose(full[name], want, rtol=1e-5, atol=1e-7), name


def test_unfreezing_a_parameter_frozen_at_setup_is_refused_at_the_step_naming_it():
    torch.manual_seed(0)
    model = TinyLM()
    model.layers[1].requires_grad_(False)
    model, opt = zs.setup(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                          zs.ZeroConfig(stage=2))
    model.layers[1].requires_grad_(True)
    tokens, targets = batch(0, 0, 0)
    loss_fn(model(tokens), targets).backward()
    with pytest.raises(RuntimeError, match=r"layers\.1\..* were frozen .* when the model was set up"):
        opt.step()
