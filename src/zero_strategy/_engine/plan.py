"""The stage, turned into a table once.

[Note: the stage is data, not branches]
Everything the hot path needs to know about a ZeRO stage is one of the booleans
below. The engine reads ``plan.reduces_in_backward`` and friends; it never asks
``if stage == 3``. Adding a stage (or a hybrid) means adding a row, not hunting for
conditionals.

| stage | optimizer state | gradients                                        | parameters |
|-------|-----------------|--------------------------------------------------|------------|
| 1     | sharded         | full buffer kept; reduce-scattered at the step   | replicated |
| 2     | sharded         | reduce-scattered per unit as soon as ready       | replicated |
| 3     | sharded         | reduce-scattered per unit as soon as ready       | sharded, gathered per unit |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShardingPlan:
    """What one ZeRO stage shards and when it communicates."""

    stage: int
    #: fp32 master weights and optimizer state live only for this rank's shard.
    shards_optimizer_state: bool
    #: Gradients are reduce-scattered per unit during backward (as soon as the unit's
    #: gradients are complete) instead of once at ``optimizer.step()``.
    reduces_in_backward: bool
    #: A full (unsharded) gradient buffer persists between micro-batches. Stage 1
    #: accumulates every micro-batch locally and reduces once per step; stages 2-3
    #: keep one only inside ``no_sync()``.
    keeps_full_gradients: bool
    #: Parameters rest as shards and are gathered per unit around its use.
    shards_parameters: bool


PLANS: dict[int, ShardingPlan] = {
    1: ShardingPlan(1, shards_optimizer_state=True, reduces_in_backward=False,
                    keeps_full_gradients=True, shards_parameters=False),
    2: ShardingPlan(2, shards_optimizer_state=True, reduces_in_backward=True,
                    keeps_full_gradients=False, shards_parameters=False),
    3: ShardingPlan(3, shards_optimizer_state=True, reduces_in_backward=True,
                    keeps_full_gradients=False, shards_parameters=True),
}


def plan_for(stage: int) -> ShardingPlan:
    """The one place a stage number becomes behaviour."""
    try:
        return PLANS[stage]
    except KeyError:
        raise ValueError(
            f"ZeRO stage {stage!r} does not exist; use 1 (optimizer state), "
            "2 (+ gradients) or 3 (+ parameters)"
        ) from None
