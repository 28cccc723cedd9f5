"""TRL's trainers through ``zero_trainer(cls)``: SFT (full and LoRA) and DPO, equal to the stock trainers (DDP).

One ``accelerate launch`` with 2 CPU processes (tests/workers/accelerate_trl.py): each case
trains a tiny Llama for 3 optimizer steps (accumulation 2, clipping, linear schedule) with
the ZeRO trainer and with the TRL trainer itself from the same weights and data; losses,
grad norms, DPO rewards and the final trainable weights must agree to fp32 tolerance.
The SFT case reads its ZeRO settings from a DeepSpeed ds_config (the migration in docs/guides/migrating-from-deepspeed.md).
"""

from __future__ import annotations

import types

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from _accelerate_launch import accelerate_launch  # noqa: E402

DS_CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "overlap_comm": True},
             "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto"}
CASES = ["sft", "sft_lora", "dpo_zero3", "dpo_zero2", "dpo_sync_refused"]


@pytest.fixture(scope="module")
def reports():
    reps, _ = accelerate_launch("accelerate_trl.py", {"cases": CASES, "ds_config": DS_CONFIG}, timeout=300,
                                use_cpu=False)
    for r in reps:
        for case in CASES:
            assert "error" not in r.get(case, {}), r.get(case, {}).get("error", f"{case} missing")
    return reps


def _equal_to_ddp(case: dict, trainer: str, stage: int) -> None:
    zero, ref = case["zero"], case["ref"]
    assert (zero["trainer"], zero["stage"]) == (trainer, stage)
    assert ref["wrapped"] == "DistributedDataParallel"  # the reference really is DDP on 2 processes
    assert len(zero["losses"]) == 3
    logged = [key for key in ("losses", "grad_norms", "rewards/chosen", "rewards/margins") if key in ref]
    assert logged == [key for key in ("losses", "grad_norms", "rewards/chosen", "rewards/margins") if key in zero]
    for key in logged:  # what the stock trainer logged, the wrapped one logged too, and equal
        assert len(ref[key]) == 3 and zero[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    assert case["weights_rel"] < 1e-5


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sft_trainer_from_a_deepspeed_config_equals_ddp(reports):
    for r in reports:
        _equal_to_ddp(r["sft"], "ZeroSFTTrainer", 3)
        assert r["sft"]["zero"]["sharded"] and len(r["sft"]["trainable"]) == 21  # every Llama weight


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sft_trainer_with_lora_equals_ddp(reports):
    for r in reports:
        case = r["sft_lora"]
        _equal_to_ddp(case, "ZeroSFTTrainer", 3)
        assert case["zero"]["wrapped"] == "PeftModel"
        assert case["trainable"] and all("lora_" in n for n in case["trainable"])  # q/v adapters, 2 layers
        assert len(case["trainable"]) == 8


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dpo_trainer_equals_ddp_with_the_reference_model_sharded_at_stage_3(reports):
    for r in reports:
        case = r["dpo_zero3"]
        _equal_to_ddp(case, "ZeroDPOTrainer", 3)
        z = case["zero"]
        assert z["ref_is_users"] and z["ref_sharded"] and z["ref_unchanged"]
        # half the parameters per rank; no gradients, masters or optimizer state for a frozen model
        assert z["ref_bytes_by_category"]["params"] == z["ref_full_bytes"] // 2
        assert sum(v for k, v in z["ref_bytes_by_category"].items() if k != "params") == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dpo_trainer_at_stage_2_keeps_the_reference_model_replicated(reports):
    for r in reports:
        case = r["dpo_zero2"]
        _equal_to_ddp(case, "ZeroDPOTrainer", 2)
        assert case["zero"]["ref_is_users"] and not case["zero"]["ref_sharded"] and case["zero"]["ref_unchanged"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sync_ref_model_is_refused_at_stage_3(reports):
    for r in reports:
        assert "sync_ref_model" in (r["dpo_sync_refused"]["raised"] or "")


def test_zero_trainer_builds_one_class_per_trainer_class():
    from transformers import Trainer
    from trl import DPOTrainer, SFTTrainer

    from zero_strategy.transformers import ZeroTrainer, ZeroTrainerMixin, zero_trainer

    assert zero_trainer(Trainer) is ZeroTrainer
    sft = zero_trainer(SFTTrainer)
    assert sft is zero_trainer(SFTTrainer) and zero_trainer(sft) is sft
    assert sft.__name__ == "ZeroSFTTrainer" and sft.__mro__[1:3] == (ZeroTrainerMixin, SFTTrainer)
    assert issubclass(zero_trainer(DPOTrainer), DPOTrainer)
    with pytest.raises(TypeError, match="Trainer subclass"):
        zero_trainer(object)


def test_training_arguments_with_deepspeed_get_the_migration_in_the_error():
    from zero_strategy.transformers import ZeroTrainer

    with pytest.raises(ValueError, match=r'zero_config="ds_config.json"'):
        ZeroTrainer(model=None, args=types.SimpleNamespace(deepspeed="ds_config.json"))
