"""Optimizer step hooks and LR schedulers fire exactly once per step, on the calling thread.

The user may hold either optimizer object: their own (hooks registered and a scheduler
built before ``setup``) or the ZeroOptimizer ``setup`` returned (Accelerate, Lightning and
users build schedulers on that one). Oracle: the same loop on a plain torch model, whose
hooks fire once per ``step()`` and whose scheduler gives the learning rates compared here.
Every stage and the CPU-offloaded step (which steps group by group on a worker thread).
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import zero_strategy as zs
from _models import TinyLM, batch, loss_fn, param_groups

CONFIGS = {"zero1": dict(stage=1), "zero2": dict(stage=2), "zero3": dict(stage=3),
           "zero2_offload": dict(stage=2, offload_optimizer="cpu"),
           "zero3_offload": dict(stage=3, offload_optimizer="cpu", offload_params="cpu")}
STEPS = 3


def _train(model, optimizer, schedulers):
    for step in range(STEPS):
        tokens, targets = batch(0, step, 0)
        loss_fn(model(tokens), targets).backward()
        optimizer.step()
        for s in schedulers:
            s.step()
        optimizer.zero_grad()


def _recorder(calls, name):
    return lambda opt, args, kwargs: calls.append((name, threading.get_ident(), opt))


@pytest.mark.parametrize("name", CONFIGS)
def test_step_hooks_fire_once_per_step_on_the_calling_thread(name):
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    inner = torch.optim.AdamW(param_groups(model))
    calls: list = []
    inner.register_step_pre_hook(_recorder(calls, "inner_pre"))
    inner.register_step_post_hook(_recorder(calls, "inner_post"))
    model, zopt = zs.setup(model, inner, zs.ZeroConfig(**CONFIGS[name]))
    zopt.register_step_pre_hook(_recorder(calls, "zero_pre"))
    zopt.register_step_post_hook(_recorder(calls, "zero_post"))
    handles = [register_optimizer_step_pre_hook(_recorder(calls, "global_pre")),
               register_optimizer_step_post_hook(_recorder(calls, "global_post"))]
    try:
        _train(model, zopt, [])
    finally:
        for h in handles:
            h.remove()
    counts = {k: sum(1 for c in calls if c[0] == k) for k in
              ("inner_pre", "inner_post", "zero_pre", "zero_post", "global_pre", "global_post")}
    assert counts == dict.fromkeys(counts, STEPS), counts
    assert {c[1] for c in calls} == {threading.get_ident()}, "a hook fired on another thread"
    assert all(c[2] is inner for c in calls if c[0].startswith("inner"))
    assert all(c[2] is zopt for c in calls if c[0].startswith(("zero", "global")))


@pytest.mark.parametrize("name", CONFIGS)
def test_lr_schedulers_on_either_optimizer_follow_a_plain_model(name):
    torch.manual_seed(0)
    plain = TinyLM(layers=2)
    plain_opt = torch.optim.AdamW(param_groups(plain))
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain_opt, lambda s: 1.0 / (1 + s))
    _train(plain, plain_opt, [plain_sched])

    torch.manual_seed(0)
    model = TinyLM(layers=2)
    inner = torch.optim.AdamW(param_groups(model))
    on_inner = torch.optim.lr_scheduler.LambdaLR(inner, lambda s: 1.0 / (1 + s))  # built before setup
    model, zopt = zs.setup(model, inner, zs.ZeroConfig(**CONFIGS[name]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would be wrong
        _train(model, zopt, [on_inner])
    assert [g["lr"] for g in zopt.param_groups] == [g["lr"] for g in plain_opt.param_groups]
    assert on_inner.get_last_lr() == plain_sched.get_last_lr()

    torch.manual_seed(0)
    model = TinyLM(layers=2)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(**CONFIGS[name]))
    on_zero = torch.optim.lr_scheduler.LambdaLR(zopt, lambda s: 1.0 / (1 + s))  # built after setup
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(model, zopt, [on_zero])
    assert on_zero.get_last_lr() == plain_sched.get_last_lr()


def test_stepping_the_original_optimizer_object_after_setup_is_refused():
    """It would step master shards without gradients: a silent no-op on a plain-looking loop."""
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    inner = torch.optim.AdamW(param_groups(model))
    model, zopt = zs.setup(model, inner, zs.ZeroConfig(stage=2))
    tokens, targets = batch(0, 0, 0)
    loss_fn(model(tokens), targets).backward()
    with pytest.raises(RuntimeError, match="call step\\(\\) and zero_grad\\(\\) on the optimizer setup returned"):
        inner.step()
    zopt.step()  # the returned one steps
