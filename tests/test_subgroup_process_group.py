"""``setup(..., process_group=sub)`` trains each subgroup exactly like ``DDP(model, process_group=sub)``.

Four gloo ranks form two pairs, [0, 1] and [2, 3] (workers/subgroup.py). Every rank
builds its model from its own seed and each pair trains on its own data, so a
collective that runs over the world instead of the pair, or a broadcast whose
source is a group rank read as a global rank, shows up as a pair that differs from
its DDP reference or whose two replicas disagree. The reference is torch DDP over
the same subgroup (it, too, starts every member from the group's first rank).

Also: a rank that passes a group it is not a member of gets a ValueError that
names the problem and the fix, while the members train normally; a checkpoint
saved and loaded by each pair (into its own directory) restores that pair's weights.

Tolerance: fp32, losses and final weights within 1e-5 relative (as tests/test_parity_ddp.py).
"""

from __future__ import annotations

import pytest

from _compare import rel
from _launch import launch

pytestmark = pytest.mark.multiprocess

CASES = [
    dict(config=dict(stage=1)),
    dict(config=dict(stage=2)),
    dict(config=dict(stage=3)),
    dict(config="zero3_offload"),  # stage 3, optimizer state and parameter shards in host memory
    dict(config=dict(stage=3), split="new_subgroups"),
    dict(config=dict(stage=3), meta=True),  # materialized unit by unit, broadcast within the pair
    dict(config=dict(stage=2), accum=2, clip=0.05),  # no_sync + global norm over the pair's shards
]
TOL = 1e-5


def _key(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(case.items()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], dict]:
    """One 4-rank run of every case: (each rank's report, the checkpoint case)."""
    checkpoint_case = dict(config=dict(stage=3), checkpoint=str(tmp_path_factory.mktemp("subgroup_ckpt")))
    reports = launch("subgroup.py", 4, {"cases": CASES + [checkpoint_case], "non_member": True}, timeout=420)
    return reports, checkpoint_case


def results_for(runs, case: dict) -> list[dict]:
    """The four ranks' results for ``case``; a worker error fails only the tests that need that case."""
    per_rank = []
    for rank, rep in enumerate(runs[0]):
        res = next((r for r in rep["results"] if _key(r["case"]) == _key(case)), None)
        if res is None:
            earlier = [r["error"] for r in rep["results"] if "error" in r]
            pytest.fail(f"rank {rank} did not run {case}" + (f"; an earlier case failed:\n{earlier[0]}"
                                                             if earlier else ""))
        assert "error" not in res, f"rank {rank}, case {case}:\n{res['error']}"
        per_rank.append(res)
    return per_rank


@pytest.mark.parametrize("case", CASES, ids=_key)
def test_each_pair_trains_like_ddp_over_its_subgroup(runs, case):
    per_rank = results_for(runs, case)
    for rank, res in enumerate(per_rank):
        assert (res["group_rank"], res["group_size"]) == (rank % 2, 2)
        for step, (lz, lr) in enumerate(zip(res["losses_zero"], res["losses_ref"], strict=True)):
            assert rel(lz, lr) <= TOL, f"rank {rank} step {step}: loss {lz} vs DDP {lr}"
        assert res["weight_rel_diff"] <= TOL, (
            f"rank {rank}: final weights differ from DDP over its pair by {res['weight_rel_diff']:.3g} "
            f"(worst tensor {res['worst_tensor']})")
        assert res["pair_agrees"], f"rank {rank}: the two replicas of its pair hold different weights"
    # the pairs really are independent: different starting weights and different data
    assert per_rank[0]["start_weight"] == per_rank[1]["start_weight"]
    assert per_rank[2]["start_weight"] == per_rank[3]["start_weight"]
    assert per_rank[0]["start_weight"] != per_rank[2]["start_weight"]
    assert per_rank[0]["losses_ref"] != per_rank[2]["losses_ref"]


def test_a_checkpoint_saved_and_loaded_by_each_pair_restores_that_pairs_weights(runs):
    for rank, res in enumerate(results_for(runs, runs[1])):
        assert res["checkpoint_restored_max_abs"] == 0.0, f"rank {rank}"
        assert res["weight_rel_diff"] <= TOL


def test_a_rank_outside_the_group_it_passes_gets_a_clear_error(runs):
    reps = runs[0]
    assert "non_member_crash" not in reps[3], reps[3].get("non_member_crash")
    message = reps[3]["non_member_error"]
    assert message is not None, "setup accepted a group this rank is not a member of"
    assert "not a member of the process_group" in message and "global rank 3" in message
    assert "new_subgroups" in message and "process_group=None" in message  # the fix


def test_the_members_of_that_group_are_untouched(runs):
    reps = runs[0]
    for rank in (0, 1):
        assert reps[rank].get("member_ok") is True, reps[rank].get("non_member_crash")
