"""Smoke test of recipes/accelerate_finetune.py: 2 CPU processes (accelerate launch with
recipes/accelerate/cpu_2proc.yaml), a few steps on tiny models, classification and causal-LM.

Judged by the printed final line and the files (~30% of 2-rank CPU runs abort in
interpreter teardown after finishing their work): the saved directory reloads with
``from_pretrained`` and gives the logits the trained, sharded model gave, and the
loss/memory PNG and per-step metrics exist. Needs the dataset package (vaderSentiment).
"""

from __future__ import annotations

import re
import sys

import pytest

from _recipe_helpers import ROOT, check_outputs, free_port, run, tiny_bert, tiny_llama

pytestmark = pytest.mark.multiprocess
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("matplotlib")
sys.path.insert(0, str(ROOT / "recipes"))
import data  # noqa: E402

if not data.dataset_available():
    pytest.skip(f"recipe dataset not installed: {data.DATASET_INSTALL}", allow_module_level=True)

RECIPE = ROOT / "recipes" / "accelerate_finetune.py"
CONFIG = ROOT / "recipes" / "accelerate" / "cpu_2proc.yaml"


@pytest.mark.parametrize("task", ["classification", "causal-lm"])
def test_accelerate_recipe_two_ranks(task, tmp_path):
    model = (tiny_bert if task == "classification" else tiny_llama)(tmp_path / "model")
    out = tmp_path / "out"
    rc, log = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIG),
                   "--main_process_port", str(free_port()), str(RECIPE), "--task", task, "--model", str(model),
                   "--max-steps", "3", "--batch-size", "8", "--accum", "2", "--lr", "1e-3", "--log-every", "1",
                   "--output-dir", str(out)], timeout=120)
    assert re.search(r"^final: held-out .* 3 steps", log, re.M), f"no final line (exit code {rc}):\n{log[-4000:]}"
    assert re.search(r"^step 3/3 loss [0-9.]+ [0-9.]+ samples/s MiB: r0 dev [0-9.]+ host [0-9.]+ sent", log, re.M)
    if task == "causal-lm":  # generate with a different length per rank returned on both
        assert "rank 0: generate(synced_gpus=True) returned 7 tokens" in log, log[-3000:]
        assert "rank 1: generate(synced_gpus=True) returned 9 tokens" in log, log[-3000:]
    check_outputs(out, task, model, 3, log)
    assert (out / "checkpoint" / "zero_model").is_dir()
