"""Count the collectives of each phase of a step on models whose units have several flat groups.

args["cases"]: dicts with model ("moe_blocks" | "moe" | "vlm", tests/_routed_models.py), stage
(2 | 3), offload (None | "cpu"), threshold (``param_persistence_threshold``: 17 keeps the
16-element biases and norms whole beside the sharded matrices, so a unit has a sharded and a
persistent group per member), steps, reduce_limit (optional: ``COALESCE_REDUCE_ELEMENTS`` for the
run, so that small test models have groups above it). Trains with the rank-disjoint routing of tests/workers/routed.py
beside its plain reference on the global batch, and reports per step the calls and elements of
each collective kind in forward, backward and the step, the units' group counts, and the largest
relative difference of the final weights from the reference.
"""

from __future__ import annotations

import copy

import torch.distributed as dist

from _worker import finish, run_cases, start, worst_rel_diff
from routed import batches, build, loss_of, make_optimizer

import zero_strategy as zs
from zero_strategy._engine import reduce

KINDS = ("all_gather", "reduce_scatter")
DEFAULT_REDUCE_LIMIT = reduce.COALESCE_REDUCE_ELEMENTS


def _delta(now: dict, before: dict | None) -> dict:
    return {k: [now[k]["calls"] - (before[k]["calls"] if before else 0),
                now[k]["volume_elements"] - (before[k]["volume_elements"] if before else 0)] for k in KINDS}


def run(case: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reduce.COALESCE_REDUCE_ELEMENTS = case.get("reduce_limit", DEFAULT_REDUCE_LIMIT)
    base = build(case["model"])
    ref = copy.deepcopy(base)
    ref_opt = make_optimizer(case, ref)
    model = copy.deepcopy(base)
    cfg = zs.ZeroConfig(stage=case["stage"], param_persistence_threshold=case.get("threshold", 0),
                        offload_optimizer=case.get("offload"),
                        offload_params=case.get("offload") if case["stage"] == 3 else None,
                        collective_timeout=20.0)
    model, zopt = zs.setup(model, make_optimizer(case, model), cfg)
    engine = zs.api._engine_of(model)
    units = [dict(name=u.name, groups=len(u.groups), sharded=len(u.sharded_groups),
                  trainable=sum(g.trainable for g in u.groups),
                  whole_trainable=sum(g.trainable and not g.shard_params for g in u.groups),
                  # per group: (padded elements, trainable, sharded)
                  elements=[(g.padded_numel, g.trainable, g.shard_params) for g in u.groups]) for u in engine.units]
    phases = []
    for step in range(case.get("steps", 3)):
        total = sum(loss_of(ref, *batches(case, r, step)) for r in range(world)) / world
        total.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_of(model, *batches(case, rank, step))
        forward = engine.comm.stats.as_dict()
        loss.backward()
        backward = engine.comm.stats.as_dict()
        zopt.step()  # takes the counters of the step and resets them
        zopt.zero_grad()
        phases.append(dict(forward=_delta(forward, None), backward=_delta(backward, forward),
                           step=_delta(engine.last_step_comm, backward)))
    worst, name = worst_rel_diff(zs.full_state_dict(model), ref.state_dict())
    zs.teardown(model)
    return dict(case=case, phases=phases, units=units, weight_rel_diff=worst, worst=name)


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run)})


if __name__ == "__main__":
    main()
