"""Bad input to setup and to the optimizer gets an error that names the problem and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import zero_strategy as zs
from _models import TinyLM, batch, loss_fn


def fresh():
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.LBFGS(ps),
    lambda ps: torch.optim.SparseAdam(ps),
])
def test_an_optimizer_no_layout_can_shard_is_refused(make_opt):
    """Adafactor and Muon step whole parameters (tests/test_ownership_layout.py); these cannot be sharded."""
    model = TinyLM(layers=2)
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(TypeError, match=rf"cannot shard {type(opt).__name__}: it needs .*first-order optimizer"):
        zs.setup(model, opt, "zero2")


def test_optimizer_that_already_stepped_is_refused():
    model, opt = fresh()
    loss_fn(model(batch(0, 0, 0)[0]), batch(0, 0, 0)[1]).backward()
    opt.step()
    with pytest.raises(ValueError, match="already stepped.*before the first optimizer.step"):
        zs.setup(model, opt, "zero1")


def test_optimizer_over_another_models_parameters_is_refused():
    model, _ = fresh()
    other = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="not in the model"):
        zs.setup(model, torch.optim.SGD(other.parameters(), lr=0.1), "zero2")


def test_setting_up_twice_is_refused():
    model, opt = fresh()
    model, zopt = zs.setup(model, opt, "zero3")
    with pytest.raises(ValueError, match="already set up"):
        zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), "zero3")
    with pytest.raises(ValueError, match="already set up"):
        zs.setup(nn.Linear(2, 2), zopt, "zero3")


def test_a_device_other_than_the_models_is_refused():
    model, opt = fresh()
    with pytest.raises(ValueError, match="device=meta but the model's parameters are on cpu"):
        zs.setup(model, opt, "zero3", device="meta")


def test_unknown_config_key_is_refused_with_a_suggestion():
    model, opt = fresh()
    with pytest.raises(zs.ZeroConfigError, match="did you mean 'stage'"):
        zs.setup(model, opt, {"stag": 2})


def test_unit_classes_matching_nothing_lists_what_exists():
    model, opt = fresh()
    with pytest.raises(ValueError, match="matched no module.*Block"):
        zs.setup(model, opt, zs.ZeroConfig(stage=3, unit_classes=("DecoderLayer",)))


def test_fp16_backward_without_loss_scaling_is_refused_at_step():
    model, opt = fresh()
    model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=2, precision="fp16"))
    tokens, targets = batch(0, 0, 0)
    loss_fn(model(tokens), targets).backward()
    with pytest.raises(RuntimeError, match=r"optimizer.backward\(loss\)"):
        zopt.step()


def test_step_with_closure_and_add_param_group_are_refused():
    model, opt = fresh()
    model, zopt = zs.setup(model, opt, "zero2")
    with pytest.raises(ValueError, match="closure"):
        zopt.step(lambda: 0.0)
    with pytest.raises(NotImplementedError, match="before calling zero_strategy.setup"):
        zopt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


def test_plain_model_has_no_engine():
    with pytest.raises(ValueError, match="not set up"):
        zs.full_state_dict(nn.Linear(2, 2))


def test_trainable_parameter_missing_from_optimizer_warns_and_stays_fixed():
    model, _ = fresh()
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if n != "final_norm.weight"], lr=0.5)
    before = model.final_norm.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, zopt = zs.setup(model, opt, "zero3")
    assert any("in no optimizer param group" in str(w.message) for w in caught)
    tokens, targets = batch(0, 0, 0)
    loss_fn(model(tokens), targets).backward()
    zopt.step()
    assert torch.equal(zs.full_state_dict(model)["final_norm.weight"], before)
