"""ZeroTrainer (transformers.Trainer on a ZeroAccelerator) under ``accelerate launch`` with 2 CPU processes.

One launch (tests/workers/accelerate_hf_trainer.py): a tiny Llama trained for 4 steps with
accumulation, clipping and a linear schedule under zero3, checkpointing every 2 steps (asynchronously);
the stock Trainer (DDP) on the same weights and data as ground truth; a fresh
ZeroTrainer under zero2 resuming from checkpoint-2; ``from_pretrained`` of checkpoint-4.
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _accelerate_launch import accelerate_launch  # noqa: E402


@pytest.fixture(scope="module")
def reports():
    # the checkpoints are saved asynchronously (the config's async_save); the resume waits for them
    return accelerate_launch("accelerate_hf_trainer.py", {"save_preset": {"preset": "zero3", "async_save": True},
                                                          "load_preset": "zero2"},
                             timeout=240, use_cpu=False)[0]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_zero_trainer_equals_the_stock_ddp_trainer(reports):
    for r in reports:
        assert (r["accelerator"], r["num_processes"], r["stage_a"]) == (["ZeroAccelerator"], 2, 3)  # a ZeroAccelerator
        assert r["model_is_users"]
        assert r["ref_model_type"] == "DistributedDataParallel"
        # one grad_norm per logged loss on both sides: an empty list on both would compare nothing
        assert len(r["grad_norms_ref"]) == len(r["losses_a"]) > 0
        assert r["grad_norms_a"] == pytest.approx(r["grad_norms_ref"], rel=1e-5)
        assert r["ddp_rel"] < 1e-5


@pytest.mark.multiprocess
@pytest.mark.slow
def test_checkpoints_hold_every_ranks_shard(reports):
    for r in reports:
        assert r["background_saves"] == 2  # checkpoint-2 and checkpoint-4, complete when train() returned
        assert {"rank00000-of-00002.safetensors", "metadata.json"} <= set(r["zero_files_last"])
        assert {"zero_checkpoint", "model.safetensors", "config.json", "scheduler.pt",
                "trainer_state.json"} <= set(r["checkpoint_files"])
        assert {"rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"} <= set(r["zero_files"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resume_from_checkpoint_continues_the_same_run(reports):
    for r in reports:
        assert r["stage_b"] == 2  # resumed under another stage
        assert r["resume_rel"] < 1e-6
        assert r["losses_b"] == pytest.approx(r["losses_a"], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_saved_model_reloads_with_from_pretrained(reports):
    assert reports[0]["from_pretrained_rel"] < 1e-6
