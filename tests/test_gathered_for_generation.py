"""``zs.gathered_for_generation(model)``: a stage-3 ``generate()`` that gathers each unit once.

Oracle: an unsharded copy of the same tiny Llama generating the same prompts (greedy, and
sampled from one seed), per rank on 2 gloo ranks with prompts of different lengths; for
training, torch DDP on the same batches without generating. The gather count is read from
the engine's all-gather counter: inside the block one all-gather per sharded flat group for
the whole generate(); without it one per group per new token (tests/workers/generation_gather.py).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _launch import launch  # noqa: E402

CASES = [
    {"name": "zero3", "kind": "generate", "config": "zero3"},
    {"name": "zero3_offload", "kind": "generate", "config": "zero3_offload"},
    {"name": "zero3_offload_nvme", "kind": "generate", "config": "zero3_offload_nvme"},
    {"name": "zero2", "kind": "generate", "config": "zero2"},
    {"name": "tiny_budget", "kind": "generate", "config": "zero3", "budget": 1024},
    {"name": "training", "kind": "training", "config": "zero3"},
    {"name": "refusals", "kind": "refusals", "config": "zero3"},
]


@pytest.fixture(scope="module")
def reports():
    reps = launch("generation_gather.py", 2, {"cases": CASES}, timeout=150)
    for r in reps:
        for case in CASES:
            assert "error" not in r[case["name"]], r[case["name"]].get("trace", r[case["name"]])
    return reps


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["zero3", "zero3_offload", "zero3_offload_nvme"])
def test_stage_3_generates_what_the_plain_model_does_gathering_each_unit_once(reports, name):
    for r in reports:
        case = r[name]
        assert case["greedy_equal"] and case["sampled_equal"] and case["per_unit_equal"]
        assert case["uneven_equal"]  # ranks that stop at different steps (no synced_gpus needed inside)
        assert case["sharded_groups"] > 4  # root parts and blocks, every parameter sharded
        assert case["gathers_in_block"] == case["sharded_groups"]  # once per group for the whole call
        assert case["gathers_without_block"] >= 6 * case["sharded_groups"]  # 6 new tokens, each gathering all
        assert case["states_after"] == ["sharded"]  # released at exit
        assert case["log"] == []


@pytest.mark.multiprocess
def test_stage_2_is_untouched(reports):
    for r in reports:
        case = r["zero2"]
        assert case["stage"] == 2 and case["sharded_groups"] == 0
        assert case["greedy_equal"] and case["sampled_equal"]
        assert case["gathers_in_block"] == 0 == case["gathers_without_block"]


@pytest.mark.multiprocess
def test_a_budget_the_model_exceeds_falls_back_to_per_unit_gathers_with_one_log_line(reports):
    rank0, rank1 = reports
    for r in reports:
        case = r["tiny_budget"]
        assert case["greedy_equal"] and case["sampled_equal"] and case["uneven_equal"]  # synced_gpus again
        assert case["gathers_in_block"] == case["gathers_without_block"]  # per unit, as without the block
    assert len(rank0["tiny_budget"]["log"]) == 1 and "per unit" in rank0["tiny_budget"]["log"][0]
    assert rank1["tiny_budget"]["log"] == []  # a rank-0 line (the decision is the same on every rank)


@pytest.mark.multiprocess
def test_generating_between_micro_batches_and_steps_leaves_training_equal_to_ddp(reports):
    for r in reports:
        case = r["training"]
        assert case["losses"] == pytest.approx(case["ref_losses"], rel=1e-5)
        assert case["weights_rel"] < 1e-5, case["worst"]
        assert case["states_after"] == ["sharded"]


@pytest.mark.multiprocess
def test_writes_and_grad_forwards_are_refused_and_an_exception_still_releases(reports):
    for r in reports:
        case = r["refusals"]
        assert "read-only" in case["raised"]["write"] and "gathered_parameters" in case["raised"]["write"]
        assert "torch.no_grad()" in case["raised"]["grad_forward"]
        assert case["raised"]["exception"] == "'inside'"
        assert case["states"] == {"write": ["sharded"], "grad_forward": ["sharded"], "exception": ["sharded"]}
        # the write was discarded and nothing else moved: the next step equals DDP's first
        assert case["losses"] == pytest.approx(case["ref_losses"], rel=1e-5)
        assert case["weights_rel"] < 1e-5
