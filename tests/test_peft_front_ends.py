"""PEFT LoRA at stages 1-3 through Lightning, Accelerate and ZeroTrainer, as their users write it.

Each front end trains a LoRA on a tiny Llama on 2 CPU processes with every adapter
sharded (``param_persistence_threshold=0``) and makes the PEFT calls its users make:
``get_peft_model_state_dict``, the adapter's ``save_pretrained`` the front end's way,
``generate()`` with a different length per rank, ``merge_and_unload()`` and saving the
merged model. The reference is a plain PEFT model trained on the whole global batch
(Lightning, Accelerate: tests/_peft_models.py) or the stock ``Trainer`` with DDP on the
same data (ZeroTrainer). Files are reloaded here, in a plain process, with peft alone.

* Lightning (tests/workers/peft_lightning.py): the calls in ``on_train_end`` while
  sharded (``save_pretrained(is_main_process=trainer.is_global_zero)``), then after
  ``fit`` with ``if trainer.is_global_zero: model.save_pretrained(d)``.
* Accelerate (tests/workers/peft_accelerate.py): ``unwrap_model(model).save_pretrained(d,
  is_main_process=..., save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))``.
* ZeroTrainer (tests/workers/peft_hf_trainer.py): ``trainer.save_model(d)``.
"""

from __future__ import annotations


import pytest

pytest.importorskip("peft")
pytest.importorskip("lightning")
pytest.importorskip("accelerate")

import torch  # noqa: E402

from _launch import launch  # noqa: E402
from _peft_models import PROBE, assert_same_files, tiny_llama  # noqa: E402
from _accelerate_launch import accelerate_launch  # noqa: E402

STAGES = ["stage1", "stage2", "stage3"]
TOL = 1e-5


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory):
    return launch("peft_lightning.py", 2, {"always_init": False}, timeout=300,
                  out=tmp_path_factory.mktemp("peft_lightning"))


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    return accelerate_launch("peft_accelerate.py", {}, timeout=300, out=tmp_path_factory.mktemp("peft_accelerate"),
                             use_cpu=False)[0]


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    return accelerate_launch("peft_hf_trainer.py", {}, timeout=300, out=tmp_path_factory.mktemp("peft_hf_trainer"),
                             use_cpu=False)[0]


def runs(request, front_end: str, stage: str) -> list[dict]:
    """Per rank, the report of the PEFT calls on the sharded model."""
    reports = request.getfixturevalue(f"{front_end}_run")
    if front_end == "lightning":
        return [r[stage]["during_fit"] for r in reports]
    return [r[stage] for r in reports]


def logits_of_reloaded(adapter_dir) -> torch.Tensor:
    from peft import PeftModel

    model = PeftModel.from_pretrained(tiny_llama(), adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


FRONT_ENDS = ["lightning", "accelerate", "trainer"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_adapter_state_and_saved_adapter_equal_the_reference(request, front_end, stage):
    per_rank = runs(request, front_end, stage)
    for res in per_rank:
        assert res["adapter_state_keys"] and res["adapter_state_diff"] < TOL
        assert res["trained_distance"] > 1e-3  # the reference really moved away from the init
    saved = per_rank[0]
    assert_same_files(saved["adapter_dir"], saved["ref_adapter_dir"])
    assert torch.allclose(logits_of_reloaded(saved["adapter_dir"]), logits_of_reloaded(saved["ref_adapter_dir"]),
                          atol=TOL, rtol=0)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_generate_with_different_lengths_and_early_eos_per_rank_equals_the_reference(request, front_end, stage):
    per_rank = runs(request, front_end, stage)
    for res in per_rank:
        assert res["generated"] == res["generated_ref"]
        assert res["generated_eos"] == res["generated_eos_ref"]
    assert len(per_rank[0]["generated"][0]) != len(per_rank[1]["generated"][0])
    assert len(per_rank[0]["generated_eos"][0]) < len(per_rank[1]["generated_eos"][0])  # rank 0 hit its EOS


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("front_end", ["accelerate", "trainer"])
def test_merged_model_saved_while_sharded_equals_the_reference(request, front_end, stage):
    saved = runs(request, front_end, stage)[0]
    assert_same_files(saved["merged_dir"], saved["ref_merged_dir"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_lightning_rank_zero_save_after_fit_equals_the_reference(lightning_run, stage):
    report = lightning_run[0][stage]
    assert report["batches_as_planned"] == [True, True, True]
    after = report["after_fit"]
    assert after["adapter_state_diff"] < TOL
    assert_same_files(after["adapter_dir"], after["ref_adapter_dir"])
    assert_same_files(after["merged_dir"], after["ref_merged_dir"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_zero_trainer_logs_the_stock_trainers_losses(trainer_run, stage):
    for report in trainer_run:
        got, want = report[stage]["losses"], report[stage]["stock_losses"]
        assert len(got) == 3 and got == pytest.approx(want, abs=1e-5)
