"""Smoke test of the long-context recipe (recipes/long_context_finetune.py) at its ``tiny`` size.

The real script under ``torch.distributed.run``: 2 gloo ranks sharing every sequence
(``sequence_parallel_size=2``, the tiled loss) against the same script in one process
without sequence parallelism, on the same sequences (the installed torch package's
docstrings, through a character tokenizer written here). The losses it prints at every step
and the held-out loss must be the one process's, within fp32 rounding; the final line states
the sequence length trained. Judged by the printed lines (~30% of 2-rank CPU runs abort at
interpreter exit after finishing).
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from _recipe_helpers import ROOT, _char_tokenizer, free_port, run

pytestmark = pytest.mark.multiprocess

pytest.importorskip("transformers")
RECIPE = ROOT / "recipes" / "long_context_finetune.py"


def launch(tmp_path, tokenizer, ranks: int, sp: int) -> tuple[str, dict]:
    out = tmp_path / f"sp{sp}"
    rc, log = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
                   str(free_port()), str(RECIPE), "--size", "tiny", "--seq-len", "512", "--steps", "4",
                   "--log-every", "1", "--sp", str(sp), "--tokenizer", str(tokenizer), "--output-dir", str(out)],
                  timeout=300)
    assert re.search(r"^final: 4 steps on sequences of 512 tokens", log, re.M), f"exit code {rc}:\n{log[-4000:]}"
    return log, json.loads((out / "result.json").read_text())


def losses(log: str) -> list[float]:
    return [float(v) for v in re.findall(r"^step \d+: loss ([0-9.]+),", log, re.MULTILINE)]


def test_two_ranks_sharing_each_sequence_train_as_one_process(tmp_path):
    tokenizer = tmp_path / "tokenizer"
    _char_tokenizer(tokenizer)
    sp_log, sp = launch(tmp_path, tokenizer, ranks=2, sp=2)
    one_log, one = launch(tmp_path, tokenizer, ranks=1, sp=1)
    assert "(sp 2: 256 per rank)" in sp_log and "tiled loss on" in sp_log
    assert len(losses(sp_log)) == 4 and losses(sp_log) == pytest.approx(losses(one_log), rel=1e-4)
    assert sp["held_out_loss"] == pytest.approx(one["held_out_loss"], rel=1e-4)
    assert sp["final_loss"] < sp["first_loss"]
