"""overlap_step=True: with CPU/NVMe optimizer offload each group steps on the CPU as
soon as its gradients are reduced, during backward, and training still equals DDP.

The early steps really happen (every group of every step, counted by the engine),
collectives stay on the main thread in group order (deferred collectives included),
and misuse is refused: a second synced backward before step(), clipping after the
groups already stepped, and configurations where early steps would be wrong.

A batch dropped after its backward (``zero_grad()`` without ``step()``) cannot be
undone once its groups stepped: it raises ``OverlapStepCommitted`` at once, with the
step completed on every rank (the oracle: a plain model that stepped that batch);
a forward or a step after the gradients were cleared raise too (See [Note: a step
overlap_step began is not undone]). Without overlap_step, the work NVMe offload
defers past backward (the step's state read ahead) leaves a skipped batch exact."""

from __future__ import annotations

import functools
import tempfile

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
    tokens, targets = batch(0, 0, 0)
    logits = model(tokens)
    loss_fn(logits, targets).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"call optimizer.step\(\) after every backward outside no_sync"):
        logits.float().square().mean().backward()  # a second loss of the same forward
    with pytest.raises(RuntimeError, match=r"must be followed by optimizer.step\(\)"):
        backward(model, 1)  # the usual case is refused before it: at the next forward


def test_accumulating_inside_no_sync_is_fine():
    model, zopt = setup()
    with zs.no_sync(model):
        backward(model)
    backward(model, 1)
    zopt.step()
    zopt.zero_grad()
    assert zs.api._engine_of(model).steps_overlapped == len(zs.api._engine_of(model).trainable_groups)


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


def stepped_reference():
    """A second model that ran the same backward and called step(): what a committed step leaves."""
    model, zopt = setup()
    backward(model)
    zopt.step()
    zopt.zero_grad()
    return model, zopt


def assert_same(model, zopt, ref_model, ref_opt):
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for s, t in zip(zopt.state.values(), ref_opt.state.values()):
        for key in s:
            torch.testing.assert_close(s[key], t[key], rtol=0, atol=0)


@pytest.mark.parametrize("drop", ["optimizer", "zs"])
def test_dropping_a_backward_before_step_raises_with_the_step_completed(drop):
    model, zopt = setup()
    backward(model)
    with pytest.raises(zs.OverlapStepCommitted, match=r"must be followed by\s+optimizer.step\(\).*decide before"):
        zopt.zero_grad() if drop == "optimizer" else zs.zero_grad(model)
    assert not zopt.steps_in_flight
    assert all(p.grad is None for p in model.parameters())
    assert_same(model, zopt, *stepped_reference())
    backward(model, 1)  # training goes on from there
    zopt.step()


def test_a_forward_before_step_is_refused_and_changes_nothing():
    model, zopt = setup()
    backward(model)
    model.zero_grad()  # the skip written through the model: the next forward is the first call we see
    with pytest.raises(RuntimeError, match=r"Nothing was changed by this refusal: call\s+optimizer.step\(\)"):
        backward(model, 1)
    assert zopt.steps_in_flight and zs.api._engine_of(model).is_idle  # left for step() to complete
    with pytest.raises(zs.OverlapStepCommitted, match="applied the gradients as backward left them"):
        zopt.step()  # the gradients were cleared after the groups stepped with them
    assert_same(model, zopt, *stepped_reference())


def test_clearing_gradients_between_backward_and_step_is_refused():
    model, zopt = setup()
    backward(model)
    model.zero_grad(set_to_none=False)
    with pytest.raises(zs.OverlapStepCommitted, match="were cleared or zeroed"):
        zopt.step()
    assert_same(model, zopt, *stepped_reference())


@functools.lru_cache(maxsize=None)
def _skip_reports() -> list[dict]:
    """One 2-rank launch of tests/workers/habits.py: a batch skipped after backward (overlap_step
    and NVMe offload without it), and a block no rank uses under overlap_step."""
    skip = [(2, "cpu", True), (3, "cpu", True), (3, "nvme", True), (2, "nvme", False), (3, "nvme", False)]
    cases = [dict(scenario="skip_a_batch_after_backward", stage=s, offload=o, overlap=ov) for s, o, ov in skip]
    cases += [dict(scenario="a_block_no_rank_uses", stage=2, offload="cpu", overlap=True)]
    with tempfile.TemporaryDirectory(prefix="zs_overlap_skip_") as nvme:
        return launch("habits.py", 2, {"cases": [dict(c, nvme_path=nvme) for c in cases]}, timeout=240)


def _results(scenario):
    out = []
    for rank, rep in enumerate(_skip_reports()):
        for res in rep["results"]:
            assert "error" not in res, res["error"]
            if res["case"]["scenario"] == scenario:
                out.append((rank, res))
    return out


@pytest.mark.multiprocess
def test_a_batch_skipped_after_backward_is_exact_or_raises_with_the_step_completed():
    """overlap_step: zero_grad() raises and the model equals a plain one that stepped that batch,
    the same on both ranks. NVMe offload without it (the step's state read during backward):
    the skip is exact, as on a plain model."""
    results = _results("skip_a_batch_after_backward")
    assert len(results) == 10
    for rank, res in results:
        case = res["case"]
        assert res["committed"] == ([1] if case["overlap"] else []), (rank, case)
        assert res["weight_rel_diff"] < 1e-5, (rank, case, res["weight_rel_diff"])
        assert res["losses_zero"] == pytest.approx(res["losses_ref"], rel=1e-5), (rank, case)
        assert res["same_on_every_rank"] in (True, None), (rank, case)


@pytest.mark.multiprocess
def test_a_group_no_rank_used_stays_the_same_on_every_rank():
    """It steps during backward (with a zero gradient, as documented); step() gathers it too."""
    for rank, res in _results("a_block_no_rank_uses"):
        assert res["same_on_every_rank"] is True, (rank, res["case"])
