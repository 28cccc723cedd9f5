"""The host buffers the engine keeps for the next step never change under anyone who still holds them.

The training cycle's gradient buffers go back to a pool at ``zero_grad`` and the next backward
takes them again (See [Note: the training cycle's host buffers] in
src/zero_strategy/_mechanisms/memory.py). A buffer someone still refers to must not be reused:
an optimizer that keeps the gradients it stepped on (to log them, or to compare two steps) must
find them as they were, exactly as with torch, whose ``zero_grad`` drops ``.grad`` without
touching the tensor.
"""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from zero_strategy._mechanisms.cast_scratch import CastScratch

from _models import TinyLM, batch, loss_fn, param_groups


def _backward(model, step: int) -> None:
    tokens, targets = batch(0, step, 0)
    loss_fn(model(tokens), targets).backward()


class AdamWKeepingGradients(torch.optim.AdamW):
    """An optimizer that keeps the gradients it stepped on (to log or compare them later), as
    gradient-noise and lookahead-style optimizers do."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[list[torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure=None):
        self.seen.append([p.grad for group in self.param_groups for p in group["params"] if p.grad is not None])
        return super().step(closure)


@pytest.mark.parametrize("preset", ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_gradient_kept_across_zero_grad_keeps_its_values(preset, precision):
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = AdamWKeepingGradients(param_groups(model))
    model, zopt = zs.setup(model, optimizer, zs.ZeroConfig.preset(preset, precision=precision))
    _backward(model, 0)
    zopt.step()
    zopt.zero_grad()
    kept = [g for step in optimizer.seen for g in step]
    assert kept, "the optimizer saw no gradient"
    values = [g.clone() for g in kept]
    for step in (1, 2):  # the next steps take the pooled buffers again
        _backward(model, step)
        zopt.step()
        zopt.zero_grad()
    for i, (g, v) in enumerate(zip(kept, values)):
        assert torch.equal(g, v), f"{preset}/{precision}: gradient {i} the optimizer kept changed"


def test_the_buffers_are_taken_again_by_the_next_step():
    """Without this the pool would keep memory and save nothing."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(param_groups(model))
    model, optimizer = zs.setup(model, optimizer, zs.ZeroConfig.preset("zero2_offload", precision="bf16"))
    kept = []
    for step in range(3):
        _backward(model, step)
        optimizer.step()
        optimizer.zero_grad()
        kept.append(zs.memory_report(model).kept_bytes)
    assert kept[0] > 0
    assert kept[1] == kept[2] == kept[0], kept  # reused, not grown


def test_the_cast_scratch_hands_out_the_smallest_idle_buffer_that_fits():
    """Several idle buffers of different sizes: a take finds its buffer among them by identity
    (``list.remove`` compared the tensors elementwise, and raised on buffers of two sizes)."""
    scratch = CastScratch()
    large, small = scratch.take(1000, torch.float32), scratch.take(10, torch.float32)
    scratch.give_back(large)
    scratch.give_back(small)
    assert scratch.take(10, torch.float32) is small
    assert scratch.take(10, torch.float32) is large
