"""``ZeroTrainer`` with ``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed",
sp_size=2))`` logs the losses and ends on the weights of one process training on the whole sequences.

Issue 40. tests/workers/hf_trainer_sequence_parallel.py under ``accelerate launch`` (2 CPU
processes): four samples whose prompt is masked with -100 (the first shard of each has no
valid label), ``gradient_accumulation_steps=4``, 2 epochs, SGD, ``max_grad_norm`` clipping; the
reference trains a copy in one process with ``model(input_ids, labels).loss``; then
``trainer.evaluate()`` on the same samples against the reference's mean loss.
"""

from __future__ import annotations

import pytest

from _accelerate_launch import accelerate_launch

TOL = 1e-5


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_zero_trainer_with_sequence_parallelism_matches_one_process():
    reports, _ = accelerate_launch("hf_trainer_sequence_parallel.py", {"preset": "zero3"}, timeout=300)
    for rank, rep in enumerate(reports):
        assert rep["sp"] == 2 and rep["mesh_sp"] == [0, 1], rep
        assert rep["global_step"] == 2, rep  # one step per epoch of 4 samples: the loader's length is right
        for step, (got, want) in enumerate(zip(rep["losses"], rep["ref_losses"], strict=True)):
            assert abs(got - want) <= TOL * abs(want), f"rank {rank} step {step}: logged {got} vs one process {want}"
        assert rep["weight_rel_diff"] <= TOL, rep["weight_rel_diff"]
        # evaluate(): the eval loader is sharded too, and the loss is the whole samples' mean
        assert abs(rep["eval_loss"] - rep["ref_eval"]) <= TOL * rep["ref_eval"], (rep["eval_loss"], rep["ref_eval"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_run_resumed_mid_epoch_ends_on_the_uninterrupted_weights():
    """``train(resume_from_checkpoint=...)`` mid-epoch skips the batches already trained: the loader
    after the skip must still give each rank its shard."""
    reports, _ = accelerate_launch("hf_trainer_sequence_parallel.py", {"preset": "zero2", "resume": True}, timeout=300)
    for rep in reports:
        assert rep["resumed_steps"] == 4, rep
        assert rep["resumed_rel_diff"] <= TOL, rep
