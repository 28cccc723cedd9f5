"""On a CUDA device ``offload_states`` hands the GPU memory back: ``torch.cuda.memory_allocated``
drops by the bytes ``memory_report`` says were moved, and returns at ``reload_states``, after which
training continues bit for bit as without the round trip (skipped without CUDA).

Oracle: the layout's bytes (what ``memory_report`` counts per storage) against the caching
allocator's own count, which rounds each block up to 512 bytes, so the model is large
enough (shards of ~1M elements) that rounding stays under 1%.
"""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from _models import TinyLM, batch, loss_fn, param_groups
from _rollout import optimizer_state

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIGS = {
    "zero1": zs.ZeroConfig(stage=1, precision="bf16"),
    "zero2": zs.ZeroConfig(stage=2, precision="bf16"),
    "zero3": zs.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0),
    "zero3_fp32": zs.ZeroConfig(stage=3, param_persistence_threshold=0),
    "zero2_offload": zs.ZeroConfig.preset("zero2_offload", precision="bf16"),
}
TRAINING_ONLY = ["optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer"]


def _run(config, include=None, non_blocking=False, round_trip=True, steps=3):
    torch.manual_seed(0)
    model = TinyLM(layers=2, dim=512, vocab=2048).cuda()
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), config)
    figures = {}
    for step in range(steps):
        tokens, targets = (t.cuda() for t in batch(0, step, 0))
        loss_fn(model(tokens), targets).backward()
        zopt.step()
        zopt.zero_grad()
        if not round_trip:
            continue
        torch.cuda.synchronize()
        allocated, report = torch.cuda.memory_allocated(), zs.memory_report(model)
        zs.offload_states(model, zopt, include=include, non_blocking=non_blocking)
        torch.cuda.synchronize()
        offloaded = zs.memory_report(model)
        freed = allocated - torch.cuda.memory_allocated()
        pinned = all(t.is_pinned() for _, t in zs.api._engine_of(model).offloaded.host_copies())
        zs.reload_states(model, non_blocking=non_blocking)
        torch.cuda.synchronize()
        if step == 0:
            figures = {"freed": freed, "moved": report.device_bytes - offloaded.device_bytes,
                       "counted": offloaded.offloaded_bytes, "pinned": pinned,
                       "back": torch.cuda.memory_allocated() - allocated}
    out = zs.full_state_dict(model), optimizer_state(zopt), figures
    zs.teardown(model, keep_weights=False)
    return out


@pytest.mark.parametrize("include", [None, TRAINING_ONLY, ["optim_states"]], ids=["all", "training", "optim"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_memory_is_handed_back_and_training_continues_exactly(name, include):
    weights, state, _ = _run(CONFIGS[name], round_trip=False)
    weights_rt, state_rt, figures = _run(CONFIGS[name], include=include)
    assert all(torch.equal(weights[k], weights_rt[k]) for k in weights)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(state, state_rt) for k in a)
    assert figures["moved"] == figures["counted"]
    if name == "zero2_offload" and include == ["optim_states"]:
        assert figures["moved"] == 0  # the preset keeps the optimizer state on the host already
    else:
        assert figures["moved"] > 0 and figures["pinned"]
        assert figures["freed"] == pytest.approx(figures["moved"], rel=0.01)
    assert figures["back"] == pytest.approx(0, abs=0.01 * max(figures["moved"], 1))


def test_non_blocking_round_trip_is_exact():
    weights, state, _ = _run(CONFIGS["zero3"], round_trip=False)
    weights_rt, state_rt, figures = _run(CONFIGS["zero3"], non_blocking=True)
    assert all(torch.equal(weights[k], weights_rt[k]) for k in weights)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(state, state_rt) for k in a)
    assert figures["freed"] == pytest.approx(figures["moved"], rel=0.01)


def test_generation_runs_on_the_gpu_with_the_training_state_on_the_host():
    torch.manual_seed(0)
    model = TinyLM(layers=2, dim=512, vocab=2048).cuda()
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), CONFIGS["zero3"])
    tokens, targets = (t.cuda() for t in batch(0, 0, 0))
    loss_fn(model(tokens), targets).backward()
    zopt.step()
    zopt.zero_grad()
    with torch.no_grad():
        expected = model(tokens)
    with zs.states_offloaded(model, zopt, include=TRAINING_ONLY):
        with torch.no_grad():
            assert torch.equal(model(tokens), expected)
    zopt.step()
    zs.teardown(model, keep_weights=False)
