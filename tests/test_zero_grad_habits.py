"""Every way users clear gradients works on a ZeRO model exactly as on a plain one.

``model.zero_grad()`` (Accelerate's and many users' loops), ``zero_grad(set_to_none=False)``,
``submodule.zero_grad()`` between two accumulated micro-batches (a whole block, and one layer
inside a block, i.e. part of a flat group), ``p.grad = None`` by hand, and between backward and
step ``model.zero_grad()`` (torch then skips every parameter) or ``zero_grad(set_to_none=False)``
(torch steps with zero gradients).
Oracle: one plain torch model trained on the global batch by the same loop; 2 gloo ranks,
stages 1-3 and CPU offload; weights within fp32 tolerance (1e-5 relative), losses too.
"""

from __future__ import annotations

import pytest

from _habits import habit_reports, results_of

SCENARIOS = ("model_zero_grad", "model_zero_grad_keep_tensors", "submodule_zero_grad",
             "part_of_a_block_zero_grad", "grad_set_to_none_by_hand",
             "zero_grad_between_backward_and_step", "zeroed_in_place_between_backward_and_step")
POLICIES = ((1, None), (2, None), (3, None), (2, "cpu"), (3, "cpu"))


@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_clearing_gradients_the_users_way_matches_a_plain_model(scenario):
    results = results_of(habit_reports(SCENARIOS, POLICIES), scenario)
    assert len(results) == 2 * len(POLICIES)  # every policy on both ranks
    for rank, res in results:
        assert res["weight_rel_diff"] < 1e-5, (rank, res["case"], res["weight_rel_diff"])
        assert res["losses_zero"] == pytest.approx(res["losses_ref"], rel=1e-5), (rank, res["case"])
