"""TRL's ``SFTTrainer`` through ``zero_trainer(SFTTrainer)`` with ``SFTConfig(parallelism_config=
ParallelismConfig(sp_backend="deepspeed", sp_size=2))``: the losses it logs and the weights it ends on are
those of one process training on the whole sequences; what sequence parallelism cannot honour is
refused at construction, naming the fix.

Issue 40. tests/workers/trl_sequence_parallel.py under ``accelerate launch`` (2 CPU processes). TRL
itself routes SFT's loss under DeepSpeed's sequence parallelism to the model's own loss
(``SFTTrainer.compute_loss``), which is what ZeroTrainer computes over each whole sample; packing (several
sequences per row), losses other than the NLL, and TRL trainers with a loss of their own (DPO) are refused.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("trl")

from _accelerate_launch import accelerate_launch  # noqa: E402

TOL = 1e-5


@functools.lru_cache(maxsize=None)
def reports() -> list[dict]:
    reps, _ = accelerate_launch("trl_sequence_parallel.py", {}, timeout=300)
    return reps


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sft_trainer_with_sequence_parallelism_matches_one_process():
    for rank, rep in enumerate(reports()):
        run = rep["trained"]
        assert run["sp"] == 2 and run["global_step"] == 2, run
        assert len(run["losses"]) == 2
        for step, (got, want) in enumerate(zip(run["losses"], run["ref_losses"], strict=True)):
            assert abs(got - want) <= TOL * abs(want), f"rank {rank} step {step}: logged {got} vs one process {want}"
        assert run["weight_rel_diff"] <= TOL, run["weight_rel_diff"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_what_sequence_parallelism_cannot_honour_is_refused_naming_the_fix():
    for rep in reports():
        raised = rep["refused"]
        assert "packing=False and padding_free=False" in (raised["packing"] or ""), raised["packing"]
        assert "loss_type other than 'nll' are not supported" in (raised["dft"] or ""), raised["dft"]
        assert "DPOTrainer computes a loss of its own" in (raised["dpo"] or ""), raised["dpo"]
