"""The stage is one table: what each stage shards and when it communicates (DESIGN.md §1)."""

import dataclasses

import pytest

from zero_strategy._engine.plan import PLANS, plan_for


def test_table_rows():
    rows = {s: (p.shards_optimizer_state, p.reduces_in_backward, p.keeps_full_gradients, p.shards_parameters)
            for s, p in PLANS.items()}
    assert rows == {
        1: (True, False, True, False),   # grads kept whole, reduced once at the step
        2: (True, True, False, False),   # grads reduce-scattered per unit in backward
        3: (True, True, False, True),    # ... and parameters gathered per unit
    }


def test_plans_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan_for(2).shards_parameters = True


@pytest.mark.parametrize("stage", [0, 4, "3"])
def test_unknown_stage_is_refused(stage):
    with pytest.raises(ValueError, match="stage"):
        plan_for(stage)
