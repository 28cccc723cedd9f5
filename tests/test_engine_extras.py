"""Smaller engine services the front ends build on: value clipping, zero_grad through
the model, a release-only teardown, and stage-3 submodules called directly."""

from __future__ import annotations

import copy

import pytest
import torch

import zero_strategy as zs
from _models import TinyLM, batch, loss_fn, param_groups


def pair(stage=3, **kw):
    torch.manual_seed(0)
    ref = TinyLM(layers=2)
    model = copy.deepcopy(ref)
    model, zopt = zs.setup(model, torch.optim.SGD(param_groups(model), lr=0.1),
                           zs.ZeroConfig(stage=stage, param_persistence_threshold=0, **kw))
    return ref, torch.optim.SGD(param_groups(ref), lr=0.1), model, zopt


@pytest.mark.parametrize("stage,offload", [(1, None), (2, None), (3, None), (2, "cpu"), (3, "cpu")])
def test_clip_grad_value_equals_torch(stage, offload):
    ref, ropt, model, zopt = pair(stage, offload_optimizer=offload)
    tokens, targets = batch(0, 0, 0)
    loss_fn(ref(tokens), targets).backward()
    torch.nn.utils.clip_grad_value_(ref.parameters(), 0.01)
    ropt.step()
    loss_fn(model(tokens), targets).backward()
    zopt.clip_grad_value_(0.01)
    zopt.step()
    full = zs.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-6, atol=1e-7)


def test_zero_grad_through_the_model_clears_the_shards():
    ref, ropt, model, zopt = pair(2)
    tokens, targets = batch(0, 0, 0)
    loss_fn(model(tokens), targets).backward()
    assert any(g.grads.grad_shard is not None for g in zs.api._engine_of(model).groups)
    zs.zero_grad(model)
    assert all(g.grads.grad_shard is None for g in zs.api._engine_of(model).groups)


def test_release_only_teardown_gathers_nothing_and_frees_state():
    ref, ropt, model, zopt = pair(3)
    tokens, targets = batch(0, 0, 0)
    loss_fn(model(tokens), targets).backward()
    zopt.step()
    engine = zs.api._engine_of(model)
    zs.teardown(model, keep_weights=False)
    assert all(p.untyped_storage().nbytes() <= p.element_size() for p in model.parameters())  # released: no memory
    assert len(zopt.optimizer.state) == 0 and all(g.grads.grad_shard is None for g in engine.groups)
    with pytest.raises(ValueError, match="not set up"):
        zs.engine_of(model)


def test_stage3_submodule_owned_by_the_root_can_be_called_directly():
    ref, ropt, model, zopt = pair(3)
    tokens, targets = batch(0, 0, 0)
    for m, opt in ((ref, ropt), (model, zopt)):
        loss_fn(m(tokens), targets).backward()  # ZeRO: the end of backward releases everything
        opt.step()
        opt.zero_grad()
    h = torch.randn(2, 8, 24)
    out = model.final_norm(h)  # not through the root's forward: the root gathers it for the call
    torch.testing.assert_close(out, ref.final_norm(h), rtol=1e-5, atol=1e-6)  # the trained weights
    assert not torch.equal(ref.final_norm.weight, torch.ones(24))  # the step moved them off their init


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_load_full_state_dict_into_a_sharded_model(stage):
    torch.manual_seed(1)
    source = TinyLM(layers=2)
    wanted = {k: v.clone() for k, v in source.state_dict().items()}
    del wanted["head.weight"]  # tied: present under the embedding's name only
    ref, ropt, model, zopt = pair(stage)
    zs.load_full_state_dict(model, wanted)
    full = zs.full_state_dict(model)
    for k, v in source.state_dict().items():
        torch.testing.assert_close(full[k], v)
    tokens, _ = batch(0, 0, 0)
    torch.testing.assert_close(model(tokens), source(tokens))  # compute params rebuilt too


def test_load_full_state_dict_names_what_is_missing():
    ref, ropt, model, zopt = pair(2)
    with pytest.raises(zs.CheckpointError, match="lack 1 parameter.*final_norm.bias"):
        zs.load_full_state_dict(model, {k: v for k, v in ref.state_dict().items() if k != "final_norm.bias"})


@pytest.mark.parametrize("stage", [2, 3])
def test_engine_of_is_a_read_only_view_one_per_setup(stage):
    """``engine_of`` hands users what setup resolved, never the engine: the config, whether the
    parameters are sharded, the same view until teardown and a new one after the next setup."""
    ref, ropt, model, zopt = pair(stage)
    view = zs.engine_of(model)
    assert isinstance(view, zs.api.EngineView) and not isinstance(view, zs.api.ZeroEngine)
    assert zs.engine_of(model) is view
    assert view.config is zs.api._engine_of(model).config and view.config.stage == stage
    assert view.shards_parameters is (stage == 3)
    assert view.after_save_succeeds(lambda: None) is False  # no asynchronous save writing
    with pytest.raises(AttributeError):
        view.groups  # noqa: B018 - the engine's internals are not on the view
    zs.teardown(model)
    model, zopt = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), zs.ZeroConfig(stage=stage))
    assert zs.engine_of(model) is not view
