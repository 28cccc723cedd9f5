"""Smoke test of recipes/lora_finetune.py on 2 CPU processes: LoRA vs full fine-tune, and TRL SFT + LoRA.

Tiny models (tests/_recipe_helpers.py), a few steps on the real dataset. Judged by the
printed lines and the files: the saved adapter, reloaded here with peft alone onto a
fresh base model, gives the probe logits the trained, sharded model gave (and not the
base model's: the adapter changed something), and the LoRA run holds fewer trainable
parameters and less model state per rank than the full fine-tune.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from _recipe_helpers import ROOT, free_port, require_recipe_deps, run, tiny_bert, tiny_llama

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
require_recipe_deps("peft")
pytest.importorskip("trl")

RECIPE = ROOT / "recipes" / "lora_finetune.py"


def _launch(tmp_path, *args: str) -> tuple[str, object]:
    out = tmp_path / "out"
    rc, log = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(free_port()), str(RECIPE), "--max-steps", "3", "--batch-size", "8", "--log-every", "1",
                   "--output-dir", str(out), *args], timeout=150)
    assert re.search(r"^final: ", log, re.M), f"no final line (exit code {rc}):\n{log[-4000:]}"
    return log, out


def _reload_with_peft_alone(base, out, tokenizer):
    import torch
    from peft import PeftModel

    import data

    probe = json.loads((out / "probe.json").read_text())
    model = PeftModel.from_pretrained(base, out / "adapter").eval()
    batch = data.encode_texts(tokenizer, probe["texts"])
    with torch.no_grad():
        logits = data.probe_view(model(**batch).logits)
        with model.disable_adapter():
            base_logits = data.probe_view(model(**batch).logits)
    torch.testing.assert_close(logits, torch.tensor(probe["logits"]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base_logits, logits, atol=1e-4)  # the adapter is not a no-op
    assert probe["reload_max_abs_diff"] <= 1e-5


def test_lora_classification_against_the_full_fine_tune(tmp_path):
    import data

    model = tiny_bert(tmp_path / "bert")
    log, out = _launch(tmp_path, "--model", str(model), "--lr", "1e-2", "--full-lr", "1e-3")
    assert re.search(r"^\[LoRA\] [\d,]+ trainable of [\d,]+ parameters", log, re.M), log[-3000:]
    assert re.search(r"^final: LoRA held-out accuracy [0-9.]+ vs full fine-tune [0-9.]+ \((NOT )?within 0.02\)",
                     log, re.M)
    summary = json.loads((out / "summary.json").read_text())
    lora, full = summary["LoRA"], summary["full"]
    assert summary["world_size"] == 2 and lora["steps"] == full["steps"] == 3
    assert lora["trainable"] < full["trainable"] / 5 and lora["total"] > full["total"]
    assert lora["model_state_bytes"] < full["model_state_bytes"] / 2
    # frozen base: no optimizer state or masters for it, so those shrink with the trainable count
    assert lora["model_state_by_category"]["optimizer_state"] < full["model_state_by_category"]["optimizer_state"] / 5
    _reload_with_peft_alone(data.load_model(model), out, data.load_tokenizer(model))


def test_lora_causal_lm_through_trl_sft(tmp_path):
    from transformers import AutoModelForCausalLM

    import data

    tok_dir = tiny_llama(tmp_path / "llama")  # only its character-level tokenizer is used
    log, out = _launch(tmp_path, "--task", "causal-lm", "--tokenizer", str(tok_dir), "--lr", "1e-2")
    assert "TRL SFTTrainer + LoRA, ZeroSFTTrainer, preset zero3_offload, 2 rank(s)" in log, log[-3000:]
    assert re.search(r"^final: LoRA SFT held-out loss [0-9.]+ .*, 3 steps", log, re.M)
    assert re.search(r"formula: LoRA [0-9.]+ MiB, a full fine-tune at this preset [0-9.]+ MiB", log)
    base = AutoModelForCausalLM.from_pretrained(out / "base", local_files_only=True)
    _reload_with_peft_alone(base, out, data.load_tokenizer(tok_dir))
