"""``param.grad`` after backward on a ZeRO model: exact where torch's meaning can be kept,
loud everywhere else, never a plausible number.

The gradient lives in the flat group's shard; ``param.grad`` is a marker with the
parameter's shape, dtype and device. Oracle: a plain torch model running the same code
(for the habits that keep their meaning: old-style ``p.grad.data.zero_()``), and torch's
own shapes; everything that would read or rewrite values must raise with the fix.
One process (a world of one runs the same engine code), stages 1-3 and CPU offload.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zero_strategy as zs
from _habits import assert_same_weights
from _models import TinyLM, batch, loss_fn, param_groups

CONFIGS = {"zero1": dict(stage=1), "zero2": dict(stage=2), "zero3": dict(stage=3),
           "zero3_offload": dict(stage=3, offload_optimizer="cpu", offload_params="cpu")}
FIX = "the gradient lives in the flat group's shard"


def _pair(name):
    torch.manual_seed(0)
    plain = TinyLM(layers=2)
    model = copy.deepcopy(plain)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)),
                           zs.ZeroConfig(param_persistence_threshold=0, **CONFIGS[name]))
    return plain, torch.optim.AdamW(param_groups(plain)), model, zopt


def _backward(model, step=0):
    tokens, targets = batch(0, step, 0)
    loss_fn(model(tokens), targets).backward()


@pytest.mark.parametrize("name", CONFIGS)
def test_metadata_is_true_and_values_are_refused(name):
    _, _, model, _ = _pair(name)
    _backward(model)
    w = model.layers[0].fc1.weight
    assert w.grad is not None and w.grad.shape == w.shape and w.grad.dtype == w.dtype
    assert "ZeRO shard" in repr(w.grad)
    with pytest.raises(RuntimeError, match=FIX):
        w.grad.norm()
    with pytest.raises(RuntimeError, match=FIX):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=FIX):
        w.grad.masked_fill_(torch.ones_like(w, dtype=torch.bool), 0.0)  # gradient masking
    with pytest.raises(RuntimeError, match=FIX):
        w.grad = w.grad * 0.5


@pytest.mark.parametrize("name", CONFIGS)
def test_a_tensor_assigned_between_backward_and_step_is_refused_at_the_step(name):
    _, _, model, zopt = _pair(name)
    _backward(model)
    w = model.layers[0].fc1.weight
    w.grad = torch.zeros_like(w)
    with pytest.raises(RuntimeError, match="was replaced by a tensor after backward"):
        zopt.step()


@pytest.mark.parametrize("name", CONFIGS)
def test_old_style_manual_zeroing_matches_torch(name):
    plain, popt, model, zopt = _pair(name)
    for m, opt in ((plain, popt), (model, zopt)):
        for step in range(3):
            _backward(m, step)
            opt.step()
            for p in m.parameters():  # the pre-zero_grad() idiom: zero in place through .data
                if p.grad is not None:
                    p.grad.data.zero_()
    assert_same_weights(model, plain)
