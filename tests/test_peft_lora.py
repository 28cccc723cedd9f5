"""PEFT LoRA at stages 1-3 through the plain API gives what one single-process model gives.

Issue #12: at stage 3 with the adapters sharded, peft's ``save_pretrained`` wrote adapters
of 0-element tensors and ``merge_and_unload()`` returned a ``q_proj`` weight of shape [0].
Here 2 gloo ranks (tests/workers/peft_lora.py) train a LoRA on a tiny Llama at each
stage, ``param_persistence_threshold=0``, beside a plain PEFT model trained on the whole
global batch. Compared with that reference: the training losses, ``get_peft_model_state_dict``,
the adapter files ``save_pretrained`` writes (and their reload with peft alone, in this
plain process), ``generate()`` with a different length per rank, ``merge_and_unload()``
and the merged model's files. ``resize_token_embeddings`` works before setup and is
refused, with the fix in the message, after it. Frozen base weights hold no master and no
optimizer state: the memory report equals the ZeRO formula with the frozen count.
"""

from __future__ import annotations


import pytest

pytest.importorskip("peft")

import torch  # noqa: E402

import zero_strategy as zs  # noqa: E402
from _launch import launch  # noqa: E402
from _peft_models import VOCAB, assert_same_files, tiny_llama  # noqa: E402

CASES = [{"stage": 1}, {"stage": 2}, {"stage": 3}, {"stage": 3, "resize_before": 72}]
IDS = ["stage1", "stage2", "stage3", "stage3-resized-before-setup"]
TOL = 1e-5  # fp32; weights and logits of magnitude ~1


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return launch("peft_lora.py", 2, {"cases": CASES}, timeout=300, out=tmp_path_factory.mktemp("peft_lora"))


def result(reports, rank: int, index: int) -> dict:
    res = reports[rank]["results"][index]
    assert "error" not in res, res["error"]
    return res


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_training_and_adapter_state_equal_the_single_process_model(reports, index):
    per_rank = [result(reports, r, index) for r in range(2)]
    for step, (local0, ref) in enumerate(per_rank[0]["losses"]):
        local1 = per_rank[1]["losses"][step][0]
        assert (local0 + local1) / 2 == pytest.approx(ref, abs=1e-5), step
    for res in per_rank:
        assert res["adapter_state_diff"] < TOL
        assert res["logits_diff"] < TOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_saved_adapter_equals_the_reference_and_reloads_with_peft_alone(reports, index):
    from peft import PeftModel

    res = result(reports, 0, index)
    assert_same_files(res["adapter_dir"], res["ref_adapter_dir"])
    base = tiny_llama()
    if res["case"].get("resize_before"):
        torch.manual_seed(11)
        base.resize_token_embeddings(res["case"]["resize_before"])
    reloaded = PeftModel.from_pretrained(base, res["adapter_dir"]).eval()
    vocab = res["case"].get("resize_before") or VOCAB
    with torch.no_grad():
        logits = reloaded(input_ids=torch.arange(10).view(1, 10) % vocab).logits
    assert torch.allclose(logits, torch.tensor(res["ref_logits"]), atol=TOL, rtol=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_generate_with_a_different_length_per_rank_equals_the_reference(reports, index):
    lengths = []
    for rank in range(2):
        res = result(reports, rank, index)
        assert res["generated"] == res["generated_ref"]
        assert res["generated_eos"] == res["generated_eos_ref"]  # rank 0 stops at its own EOS
        lengths.append(len(res["generated"][0]))
    assert lengths[0] != lengths[1]  # the ranks really stopped at different steps


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_merge_and_unload_then_save_equals_the_reference(reports, index):
    res = result(reports, 0, index)
    assert_same_files(res["merged_dir"], res["ref_merged_dir"])
    for rank in range(2):
        assert result(reports, rank, index)["merged_logits_diff"] < TOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_resize_token_embeddings_after_setup_is_refused_with_the_fix(reports, index):
    message = result(reports, 0, index)["resize_after_setup"]
    assert "already set up" in message and "before zero_strategy.setup" in message


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_base_holds_no_master_and_no_optimizer_state(reports, precision):
    for rank in range(2):
        lora_run = reports[rank]["memory"][f"{precision}-lora"]
        full_run = reports[rank]["memory"][f"{precision}-full"]
        for run in (lora_run, full_run):
            n, got = run["counts"], run["report"]
            est = zs.estimate_memory(n["trainable"], frozen_params=n["frozen"], world_size=2, stage=3,
                                     precision=precision, optimizer="adamw")
            state = got["master"] + got["optimizer_state"]
            assert state == pytest.approx(est.device_optimizer, rel=0.05), (run, est)
            assert got["params"] == pytest.approx(est.device_params, rel=0.05), (run, est)
        assert lora_run["counts"]["frozen"] > 10 * lora_run["counts"]["trainable"]
        # only the adapters have fp32 state: a LoRA's is its trainable share of the full run's
        share = lora_run["counts"]["trainable"] / full_run["counts"]["trainable"]
        lora_state = lora_run["report"]["master"] + lora_run["report"]["optimizer_state"]
        full_state = full_run["report"]["master"] + full_run["report"]["optimizer_state"]
        assert lora_state == pytest.approx(share * full_state, rel=0.05)
