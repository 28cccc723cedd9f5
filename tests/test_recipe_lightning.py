"""Smoke test of recipes/lightning_finetune.py: 2 CPU processes (Lightning launches the
second), a few steps on tiny models, classification and causal-LM.

Judged by the printed final line and the files (~30% of 2-rank CPU runs abort in
interpreter teardown after finishing their work): the saved directory reloads with
``from_pretrained`` and gives the logits the trained, sharded model gave, and the
loss/memory PNG and per-step metrics exist. Needs the dataset package (vaderSentiment).
"""

from __future__ import annotations

import sys

import pytest

from _recipe_helpers import ROOT, check_recipe_run, recipe_args, require_recipe_deps, run, tiny_bert, tiny_llama

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
require_recipe_deps("lightning")

RECIPE = ROOT / "recipes" / "lightning_finetune.py"


@pytest.mark.parametrize("task", ["classification", "causal-lm"])
def test_lightning_recipe_two_ranks(task, tmp_path):
    model = (tiny_bert if task == "classification" else tiny_llama)(tmp_path / "model")
    out = tmp_path / "out"
    rc, log = run([sys.executable, str(RECIPE), *recipe_args(task, model, out)], timeout=150)
    check_recipe_run(rc, log, task, out, model)
    assert (out / "checkpoint" / "metadata.json").is_file()
