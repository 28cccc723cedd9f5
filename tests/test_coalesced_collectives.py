"""One collective per unit and kind, however many flat groups the unit has (issue 26 item 3).

A unit's flat groups (one per expert of a list, the root's parts, a persistent group of
biases and norms beside each sharded one) are all-gathered as one coalesced all-gather and
reduce-scattered as one coalesced reduce-scatter, and the step's all-gathers of the small
groups kept whole go out as one (See [Note: coalesced collectives] in _comm/collectives.py,
[Note: reduce order] in _engine/reduce.py). The count expected here is computed from the
units alone, and each model has more groups than units, so a collective per group fails it.
The elements stay what they were (the theory of tests/test_comm_volume.py), and the weights
equal the plain model's on the global batch, with ranks routing to disjoint experts and an
image tower that only rank 0's batches run (tests/workers/routed.py's cases).
"""

from __future__ import annotations

import functools

import pytest

from _launch import launch

pytestmark = pytest.mark.multiprocess

CASES = [dict(model=m, stage=s, offload=o, threshold=17)
         for m in ("moe_blocks", "moe", "vlm") for s in (2, 3) for o in (None, "cpu")]
# a limit between the persistent groups (biases, norms) and the sharded matrices: each large group is
# reduce-scattered alone, in place, and the small ones of its unit together
CASES += [dict(model="moe_blocks", stage=s, offload=None, threshold=17, reduce_limit=64) for s in (2, 3)]
TOL = 1e-5  # fp32: both sides add the same two ranks' gradients


def _key(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(case.items()))


@functools.lru_cache(maxsize=None)
def reports() -> tuple:
    return tuple(launch("collective_counts.py", 2, {"cases": CASES}, timeout=300))


def per_rank(case: dict) -> list[dict]:
    out = []
    for rank, rep in enumerate(reports()):
        res = next((r for r in rep["results"] if r["case"] == case), None)
        assert res is not None, f"rank {rank} never reached {case}: {rep['results'][-1]}"
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        out.append(res)
    return out


def reduce_calls(unit: dict, limit: int | None) -> int:
    """A unit's reduce-scatters: one per trainable group above ``limit``, one for all the others."""
    sizes = [n for n, trainable, _ in unit["elements"] if trainable]
    large = 0 if limit is None else sum(n > limit for n in sizes)
    return large + (1 if len(sizes) > large else 0)


def expected_calls(stage: int, units: list[dict], limit: int | None = None) -> dict:
    """{(phase, kind): calls} per step, from the units: one per unit that has something of that kind
    (and each group above ``limit`` reduce-scattered on its own)."""
    sharded = [u for u in units if u["sharded"]]
    whole = sum(u["whole_trainable"] for u in units)
    out = {("forward", "reduce_scatter"): 0, ("step", "reduce_scatter"): 0,
           ("backward", "reduce_scatter"): sum(reduce_calls(u, limit) for u in units)}
    if stage == 3:
        out["forward", "all_gather"] = len(sharded)  # every unit, the ones a rank skips passed too
        out["backward", "all_gather"] = sum(1 for u in sharded if u["trainable"] and u["name"] != "<root>")
        out["step", "all_gather"] = 1 if whole else 0  # all small: one coalesced all-gather
    else:
        out["forward", "all_gather"] = out["backward", "all_gather"] = 0
        out["step", "all_gather"] = 1  # the whole (tiny) model fits one coalesced all-gather
    return out


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_one_collective_per_unit_and_kind(case):
    for rank, res in enumerate(per_rank(case)):
        units = res["units"]
        groups = sum(u["trainable"] for u in units)
        assert groups > sum(1 for u in units if u["trainable"]), units  # several groups per unit: can fail
        expect = expected_calls(case["stage"], units, case.get("reduce_limit"))
        if "reduce_limit" in case:  # the limit splits some unit: can fail against one call per unit
            assert expect["backward", "reduce_scatter"] > sum(1 for u in units if u["trainable"]), units
        for step, phases in enumerate(res["phases"]):
            got = {(phase, kind): calls for phase, kinds in phases.items() for kind, (calls, _) in kinds.items()}
            assert got == expect, (rank, step, got, expect, units)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_elements_are_those_of_every_group(case):
    """Coalescing changes the count of collectives, not what they carry: every group's padded buffer once."""
    for rank, res in enumerate(per_rank(case)):
        groups = [g for u in res["units"] for g in u["elements"]]
        trained = sum(n for n, trainable, _ in groups if trainable)
        sharded = sum(n for n, _, shard in groups if shard)
        expect = {("backward", "reduce_scatter"): trained,
                  ("forward", "all_gather"): sharded,
                  ("step", "all_gather"): sum(n for n, trainable, shard in groups if trainable and not shard)}
        for phases in res["phases"]:
            got = {(p, k): phases[p][k][1] for p, k in expect}
            assert got == expect, (rank, got, expect)


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_matches_the_plain_model_on_the_global_batch(case):
    for rank, res in enumerate(per_rank(case)):
        assert res["weight_rel_diff"] <= TOL, (rank, res["worst"], res["weight_rel_diff"])
