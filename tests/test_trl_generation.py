"""TRL's GRPOTrainer through ``zero_trainer(GRPOTrainer)``: generation gathers each unit once, and trains as DDP.

One ``accelerate launch`` with 2 CPU processes (tests/workers/trl_generation.py), a GRPO script
written as TRL's docs write one (GRPOConfig, a rule-based reward, ``num_generations=2``, 3 steps,
``use_vllm=False``) on a tiny Llama. Oracle: the stock GRPOTrainer, which Accelerate runs as DDP
on the same 2 processes, with the same ``beta``: the completion tokens the reward function
received, the logged losses, rewards and KL, and the final weights must agree. The gathers each
``generate()`` issues are counted on the policy model's engine: one per sharded flat group for
the whole call when gathering once, one per group per new token otherwise.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from _accelerate_launch import accelerate_launch  # noqa: E402

CASES = ["ref", "ref_beta", "zero2", "zero3", "zero3_beta", "zero3_tiny_budget", "zero3_per_unit"]
NEW_TOKENS = 8  # GRPOConfig(max_completion_length=8); no sequence ends early (the reward never asks for EOS)


@pytest.fixture(scope="module")
def reports():
    reps, log = accelerate_launch("trl_generation.py", {"cases": CASES}, timeout=240)
    for r in reps:
        for case in CASES:
            assert case in r and "error" not in r[case], r.get(case, {}).get("error", f"{case} missing\n{log[-4000:]}")
    return reps


def _equal_to_ddp(case: dict, ref: dict) -> None:
    assert ref["wrapped"] == "DistributedDataParallel"  # the stock trainer really ran as DDP on 2 processes
    assert case["trainer"] == "ZeroGRPOTrainer" and len(case["logged"]["loss"]) == 3
    assert case["completion_ids"] == ref["completion_ids"]  # the same sampled tokens, token for token
    assert len(case["completion_ids"]) == 6  # 3 steps x 2 completions on each rank
    # the same metrics logged on both sides (TRL logs no kl with beta=0), then each one's values
    assert case["logged"].keys() == ref["logged"].keys() and {"loss", "reward"} <= ref["logged"].keys()
    for key, values in ref["logged"].items():
        assert case["logged"][key] == pytest.approx(values, rel=1e-5, abs=1e-7), key
    assert case["weights_rel"] < 1e-5, case["worst"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_grpo_at_stage_3_gathers_each_unit_once_per_generate_and_equals_ddp(reports):
    for r in reports:
        case = r["zero3"]
        _equal_to_ddp(case, r["ref"])
        assert case["stage"] == 3 and case["sharded_groups"] == 7  # embeddings, norm, head, 2 blocks: all sharded
        assert case["sharded_units"] == 3  # the root (its parts) and 2 blocks: one coalesced all-gather each
        assert case["gathers_per_generate"] == [case["sharded_units"]] * 3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_grpo_with_the_reference_model_sharded_equals_ddp(reports):
    for r in reports:
        case = r["zero3_beta"]
        _equal_to_ddp(case, r["ref_beta"])
        assert case["ref_sharded"] and case["logged"]["kl"][-1] > 0  # the KL term is live
        assert case["gathers_per_generate"] == [case["sharded_units"]] * 3


@pytest.mark.multiprocess
@pytest.mark.slow
def test_grpo_at_stage_2_equals_ddp_without_gathers(reports):
    for r in reports:
        case = r["zero2"]
        _equal_to_ddp(case, r["ref"])
        assert case["stage"] == 2 and case["gathers_per_generate"] == [0, 0, 0]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ds3_gather_for_generation_false_means_per_unit_gathers(reports):
    for r in reports:
        case = r["zero3_per_unit"]
        _equal_to_ddp(case, r["ref"])
        assert case["gathers_per_generate"] == [NEW_TOKENS * case["sharded_units"]] * 3
        assert case["log"] == []  # TRL's switch, not a budget: nothing to say


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_budget_the_model_exceeds_falls_back_to_per_unit_gathers_with_one_log_line(reports):
    rank0, rank1 = reports
    for r in reports:
        case = r["zero3_tiny_budget"]
        _equal_to_ddp(case, r["ref"])
        assert case["gathers_per_generate"] == [NEW_TOKENS * case["sharded_units"]] * 3
    (line,) = rank0["zero3_tiny_budget"]["log"]  # once for the run, not once per generate()
    assert "per unit" in line and "budget" in line
    assert rank1["zero3_tiny_budget"]["log"] == []
