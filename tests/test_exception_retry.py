"""An exception in forward or backward leaves the engine ready: the retry is exact.

The loop is the one Lightning's batch-size finder, HF ``auto_find_batch_size`` and users'
own code run: ``try: loss.backward() except torch.OutOfMemoryError: optimizer.zero_grad()``
and run the same batch again. The out-of-memory error is injected in block 1's forward, or
in backward after later blocks' gradients arrived (and, at stages 2-3, were reduced).
Oracle: one plain torch model on the global batch running the same loop; 2 gloo ranks,
stages 1-3 and CPU offload; weights within 1e-5 relative. Afterwards the engine is IDLE
and no unit stays gathered.
"""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from _habits import assert_same_weights, habit_reports, results_of, train
from _models import TinyLM, batch, loss_fn, param_groups

SCENARIOS = ("retry_after_forward_error", "retry_after_backward_error",
             "retry_after_backward_error_model_zero_grad")
POLICIES = ((1, None), (2, None), (3, None), (3, "cpu"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_retrying_the_batch_after_an_error_matches_a_plain_model(scenario):
    results = results_of(habit_reports(SCENARIOS, POLICIES), scenario)
    assert len(results) == 2 * len(POLICIES)  # every policy on both ranks
    for rank, res in results:
        assert res["weight_rel_diff"] < 1e-5, (rank, res["case"], res["weight_rel_diff"])
        assert res["losses_zero"] == pytest.approx(res["losses_ref"], rel=1e-5), (rank, res["case"])
        assert res["training_state"] == "idle" and res["units_gathered"] == [], (rank, res["case"])


def test_reset_iter_state_after_an_abandoned_backward_and_illegal_transitions_are_named():
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)),
                           zs.ZeroConfig(stage=3, param_persistence_threshold=0))
    engine = zs.api._engine_of(model)
    tokens, targets = batch(0, 0, 0)

    def boom(grad):
        raise torch.OutOfMemoryError("injected")

    def inject(module, args, out):
        out.register_hook(boom)

    model.layers[1].register_forward_hook(inject)
    with pytest.raises(torch.OutOfMemoryError):  # raised after the head's gradients arrived
        loss_fn(model(tokens), targets).backward()
    assert engine.training_state.value == "pre_backward"  # the callback never ran
    zs.reset_iter_state(model)
    assert engine.training_state.value == "idle"
    assert all(u.state.value == "sharded" for u in engine.units)
    engine.training_state = type(engine.training_state).POST_BACKWARD  # as if a callback were stuck
    with pytest.raises(AssertionError, match="illegal transition from post_backward"):
        engine._end_of_backward()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_keyboard_interrupt_in_forward_is_recovered_by_zero_grad(stage):
    """A BaseException skips torch's always_call hooks; the retry loop's zero_grad still resets."""
    torch.manual_seed(0)
    plain = TinyLM(layers=3)
    model = TinyLM(layers=3)
    model.load_state_dict(plain.state_dict())
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)),
                           zs.ZeroConfig(stage=stage, param_persistence_threshold=0, prefetch=2))
    popt = torch.optim.AdamW(param_groups(plain))
    interrupt = {"on": True}

    def maybe_interrupt(module, args):
        if interrupt["on"]:
            raise KeyboardInterrupt

    model.layers[1].fc2.register_forward_pre_hook(maybe_interrupt)
    tokens, targets = batch(0, 0, 0)
    with pytest.raises(KeyboardInterrupt):
        model(tokens)
    interrupt["on"] = False
    zopt.zero_grad()
    engine = zs.api._engine_of(model)
    assert engine.training_state.value == "idle"
    assert all(u.state.value == "sharded" for u in engine.units if u.sharded_groups)
    train(plain, popt, range(1))
    train(model, zopt, range(1))
    assert_same_weights(model, plain)
