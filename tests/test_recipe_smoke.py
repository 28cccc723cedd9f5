"""Smoke test of the main job's recipe (recipes/finetune.py) on a tiny BERT.

Runs the real script with ``torch.distributed.run`` on 2 gloo ranks for a few steps
(with gradient accumulation, so ``no_sync`` is exercised) on the real dataset, then
reloads the saved directory with ``from_pretrained`` and checks it gives the logits the
trained, sharded model gave on the probe batch. Success is judged by the printed final
line and the files, not only the exit code: ~30% of 2-rank CPU runs abort in
interpreter teardown after finishing their work.

The model is a tiny randomly initialized BERT with a character-level WordPiece
vocabulary written to tmp_path, so the test does not need the MiniLM package; it does
need the dataset package (vaderSentiment) and skips without it.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "finetune.py"

pytestmark = pytest.mark.multiprocess

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "recipes"))
import data  # noqa: E402
from _recipe_helpers import free_port, run, tiny_bert  # noqa: E402

if not data.dataset_available():
    pytest.skip(f"recipe dataset not installed: {data.DATASET_INSTALL}", allow_module_level=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("recipe") / "tiny-bert")


def test_finetune_two_ranks_saves_a_model_that_reloads(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out_dir = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(RECIPE),
           "--model", str(tiny_model), "--preset", "zero3", "--max-steps", "3", "--batch-size", "8",
           "--accum", "2", "--lr", "1e-3", "--log-every", "1", "--output-dir", str(out_dir)]
    rc, log = run(cmd, timeout=150, cold=True)
    final = re.search(r"^final: held-out accuracy ([0-9.]+) \((\d+)/(\d+); chance ([0-9.]+)\), (\d+) steps", log, re.M)
    assert final, f"no final line (exit code {rc}):\n{log[-4000:]}"
    acc, correct, total, _, steps = final.groups()
    assert int(steps) == 3
    _, held = data.load_splits()
    assert int(total) == len(held), "every held-out example is counted exactly once across ranks"
    assert 0.0 <= float(acc) <= 1.0
    assert re.search(r"^step 3/3 loss [0-9.]+ .* process rss [0-9]+ peak [0-9]+ MiB \(rank 0\), sent [0-9.]+ MiB/rank", log, re.M), log[-3000:]

    probe = json.loads((out_dir / "probe.json").read_text())
    assert probe["world_size"] == 2 and probe["steps"] == 3
    model = AutoModelForSequenceClassification.from_pretrained(out_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    with torch.no_grad():
        logits = model(**data.encode_texts(tok, probe["texts"])).logits
    torch.testing.assert_close(logits, torch.tensor(probe["logits"]), rtol=1e-5, atol=1e-5)
    # trained: the saved weights differ from the untrained checkpoint
    start = AutoModelForSequenceClassification.from_pretrained(tiny_model, local_files_only=True).eval()
    with torch.no_grad():
        assert not torch.allclose(start(**data.encode_texts(tok, probe["texts"])).logits, logits)


def test_unknown_preset_is_refused_clearly(tiny_model, tmp_path):
    rc, log = run([sys.executable, str(RECIPE), "--model", str(tiny_model), "--preset", "zero4",
                    "--output-dir", str(tmp_path / "out")], timeout=90)
    assert rc == 2, log[-3000:]
    assert "invalid choice: 'zero4'" in log and "zero3_offload" in log, log[-3000:]
    assert not (tmp_path / "out").exists()
