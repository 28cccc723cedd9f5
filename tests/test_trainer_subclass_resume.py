"""Resume through ``zero_trainer(cls)`` restores what the trainer class keeps in its own
``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` (GRPOTrainer's adaptive-entropy
state lives there), and never runs the stock optimizer save / load on a ZeRO model.

One ``accelerate launch`` with 2 CPU processes (tests/workers/trainer_subclass_resume.py). Oracle:
the uninterrupted run A; run B resumes from its checkpoint-2 into which a decoy stock
``optimizer.pt`` was put.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _accelerate_launch import accelerate_launch  # noqa: E402


@pytest.fixture(scope="module")
def reports():
    reps, _ = accelerate_launch("trainer_subclass_resume.py", {}, timeout=180)
    return reps


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_subclass_override_restores_its_state_on_resume(reports):
    for r in reports:
        assert r["mro"][:3] == ["ZeroTrainerWithExtraState", "ZeroTrainerMixin", "TrainerWithExtraState"]
        assert r["saved_at_2"]["micro_batches"] == 4  # 2 steps x 2 micro-batches, written by the subclass's save
        assert r["restored"] == r["saved_at_2"]  # read back by the subclass's own load
        assert r["end_b"] == r["end_a"] and r["end_a"]["micro_batches"] == 8  # continued from the restored state


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_stock_optimizer_checkpoint_is_neither_written_nor_read(reports):
    for r in reports:
        assert "zero_checkpoint" in r["checkpoint_files"] and "extra_state.json" in r["checkpoint_files"]
        assert "optimizer.pt" not in r["checkpoint_files"]  # the subclass's super() stopped above Trainer
        # the decoy optimizer.pt (lr=123) was not loaded: run B ends on run A's weights and losses
        assert r["resume_rel"] < 1e-6
        assert r["losses_b"] == pytest.approx(r["losses_a"], rel=1e-5)  # steps 1-2 from the checkpoint's history
