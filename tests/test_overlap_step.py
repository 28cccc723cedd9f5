"""overlap_step=True: with CPU/NVMe optimizer offload each group steps on the CPU as
soon as its gradients are reduced, during backward, and training still equals DDP.

The early steps really happen (every group of every step, counted by the engine),
collectives stay on the main thread in group order (deferred collectives included),
and misuse is refused: a second synced backward before step(), clipping after the
groups already stepped, and configurations where early steps would be wrong."""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from _launch import launch
from _models import TinyLM, batch, loss_fn, param_groups

CASES = [dict(stage=s, precision=p, accum=a, offload_optimizer="cpu", overlap_step=True)
         for s in (2, 3) for p in ("fp32", "bf16") for a in (1, 2)]
CASES += [dict(stage=3, precision="bf16", accum=1, offload_optimizer="cpu", offload_params="cpu",
               overlap_step=True, defer=True)]
CASES += [dict(stage=3, precision="fp32", accum=2, offload_optimizer="nvme", offload_params="nvme",
               overlap_step=True, optimizer="sgd")]


@pytest.mark.multiprocess
def test_early_steps_happen_and_match_ddp(tmp_path):
    cases = [dict(c, nvme_path=str(tmp_path)) for c in CASES]
    for rank, rep in enumerate(launch("parity.py", 2, {"cases": cases}, timeout=240)):
        for res in rep["results"]:
            assert "error" not in res, res["error"]
            tol = 1e-5 if res["case"]["precision"] == "fp32" else 5e-2
            assert res["weight_rel_diff"] <= tol, (rank, res["case"])
            for zero, ref in zip(res["losses_zero"], res["losses_ref"]):
                assert zero == pytest.approx(ref, rel=1e-5 if tol == 1e-5 else 2e-3), res["case"]
            steps = len(res["losses_zero"])
            assert res["steps_overlapped"] == steps * res["trainable_groups"], res["case"]


def setup(**kw):
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    return zs.setup(model, torch.optim.AdamW(param_groups(model)),
                    zs.ZeroConfig(stage=2, offload_optimizer="cpu", overlap_step=True, **kw))


def backward(model, step=0):
    tokens, targets = batch(0, step, 0)
    loss_fn(model(tokens), targets).backward()


def test_a_second_synced_backward_before_step_is_refused():
    model, zopt = setup()
    backward(model)
    with pytest.raises(RuntimeError, match=r"call optimizer.step\(\) after every backward outside no_sync"):
        backward(model, 1)


def test_accumulating_inside_no_sync_is_fine():
    model, zopt = setup()
    with zs.no_sync(model):
        backward(model)
    backward(model, 1)
    zopt.step()
    zopt.zero_grad()
    assert zs.engine_of(model).steps_overlapped == len(zs.engine_of(model).trainable_groups)


def test_clipping_after_early_steps_is_refused():
    model, zopt = setup()
    backward(model)
    with pytest.raises(RuntimeError, match="already stepped during backward"):
        zopt.clip_grad_norm_(1.0)


@pytest.mark.parametrize("kw, match", [
    (dict(stage=2), "needs optimizer offload"),
    (dict(stage=1, offload_optimizer="cpu"), "needs optimizer offload at stage 2 or 3"),
    (dict(stage=2, offload_optimizer="cpu", gradient_clipping=1.0), "cannot combine with gradient_clipping"),
    (dict(stage=2, offload_optimizer="cpu", precision="fp16"), "cannot combine with gradient_clipping or fp16"),
])
def test_configurations_where_early_steps_would_be_wrong_are_refused(kw, match):
    with pytest.raises(zs.ZeroConfigError, match=match):
        zs.ZeroConfig(overlap_step=True, **kw)
