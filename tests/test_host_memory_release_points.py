"""Freed host memory goes back to the OS where a phase ends, never between training steps.

Each release returns pages the next allocation faults in again, so one inside the training cycle
costs every step (the offloaded step fell to half the fused kernel's speed that way; See [Note:
releases where a phase ends] in src/zero_strategy/_mechanisms/memory.py). These tests count
the releases a user's loops cause: none while training, one when an evaluation follows training,
none when no-grad forwards are part of the training cycle (a reference model's logits, as TRL's
DPO computes them with PEFT), and around each checkpoint save.
"""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from zero_strategy._mechanisms import memory

from _models import TinyLM, batch, loss_fn, param_groups


@pytest.fixture
def releases(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(memory, "release_freed_host_memory", lambda: calls.append("release") or True)
    return calls


def _setup(preset: str, **overrides):
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(param_groups(model))
    return zs.setup(model, optimizer, zs.ZeroConfig.preset(preset, **overrides))


def _train_step(model, optimizer, step: int) -> None:
    tokens, targets = batch(0, step, 0)
    loss_fn(model(tokens), targets).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("preset", ["zero1", "zero2_offload", "zero3", "zero3_offload"])
def test_training_steps_release_nothing(preset, releases):
    model, optimizer = _setup(preset, precision="bf16")
    releases.clear()  # the end of setup releases once
    for step in range(4):
        _train_step(model, optimizer, step)
    assert releases == []


@pytest.mark.parametrize("preset", ["zero2_offload", "zero3"])
def test_evaluation_after_training_releases_once(preset, releases):
    model, optimizer = _setup(preset)
    for step in range(2):
        _train_step(model, optimizer, step)
    releases.clear()
    model.eval()
    with torch.no_grad():
        for step in range(3):  # three evaluation batches: one phase
            model(batch(0, 100 + step, 0)[0])
    assert releases == ["release"]
    model.train()
    for step in range(2, 4):
        _train_step(model, optimizer, step)
    assert releases == ["release"]
    with torch.inference_mode():  # the next evaluation, after more training
        model(batch(0, 200, 0)[0])
    assert releases == ["release", "release"]


def test_no_grad_forwards_inside_the_training_cycle_release_nothing(releases):
    """DPO with PEFT: each step first computes the reference logits with the same model under
    ``torch.no_grad()``, then trains on the policy's. (So an evaluation after every single step
    is taken for a part of the cycle too: from the second one on, it releases nothing.)"""
    model, optimizer = _setup("zero3")
    releases.clear()
    for step in range(4):
        tokens, targets = batch(0, step, 0)
        with torch.no_grad():
            reference = model(tokens)
        (loss_fn(model(tokens), targets) + 0.0 * reference.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert releases == []


def test_a_forward_before_any_step_releases_nothing(releases):
    model, _ = _setup("zero3")
    releases.clear()
    with torch.no_grad():
        model(batch(0, 0, 0)[0])
    assert releases == []


def test_a_checkpoint_save_releases_before_and_after(tmp_path, releases):
    model, optimizer = _setup("zero2_offload")
    _train_step(model, optimizer, 0)
    releases.clear()
    zs.save_checkpoint(tmp_path / "ckpt", model, optimizer)
    assert releases == ["release", "release"]


def test_release_host_memory_false_releases_nowhere(tmp_path, releases):
    model, optimizer = _setup("zero3", release_host_memory=False)
    _train_step(model, optimizer, 0)
    with torch.no_grad():
        model(batch(0, 1, 0)[0])
    zs.save_checkpoint(tmp_path / "ckpt", model, optimizer)
    assert releases == []
