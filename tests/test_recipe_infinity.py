"""Smoke test of the ZeRO-Infinity recipe (recipes/infinity_finetune.py) at its ``tiny`` size.

The real script under ``torch.distributed.run`` on 2 gloo ranks with ``zero3_offload_nvme``:
it writes its random-weight model directory, plans the run against this machine, loads it
sharded, trains on the torch docstrings it reads from the installed package, saves a
checkpoint at step 2 and at step 4, and exports. A second, fresh launch resumes from the
step-2 checkpoint: its steps 3 and 4 must give the first launch's losses (the resume is the
run that never stopped), and the export must load in transformers. Judged by the printed
lines and the files (~30% of 2-rank CPU runs abort at interpreter exit after finishing).
A character-level tokenizer written here stands in for the MiniLM package's.
"""

from __future__ import annotations

import re
import sys

import pytest

from _recipe_helpers import ROOT, _char_tokenizer, free_port, run

pytestmark = pytest.mark.multiprocess

transformers = pytest.importorskip("transformers")
RECIPE = ROOT / "recipes" / "infinity_finetune.py"


def launch(out, tokenizer, *extra) -> str:
    rc, log = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(free_port()), str(RECIPE), "--size", "tiny", "--steps", "4", "--output-dir", str(out),
                   "--tokenizer", str(tokenizer), "--nvme-path", str(out / "nvme"), *extra], timeout=300)
    assert "final: step 4" in log, log[-4000:]
    return log


def losses(log: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"^step (\d+): loss ([0-9.]+),", log, re.MULTILINE)}


def test_the_recipe_trains_saves_resumes_exactly_and_exports(tmp_path):
    tokenizer = tmp_path / "tokenizer"
    _char_tokenizer(tokenizer)
    out = tmp_path / "run"
    first = launch(out, tokenizer, "--save-every", "2", "--export")
    assert re.search(r"^plan: .* fits$", first, re.MULTILINE), first[-4000:]
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-4").is_dir()
    trained = losses(first)
    assert sorted(trained) == [1, 2, 3, 4] and float(trained[4]) < float(trained[1])
    assert re.search(r"step 1: .* memory per rank \d+\.\d+ GiB \d+\.\d+ GiB", first)

    resumed = launch(out, tokenizer, "--resume", str(out / "checkpoint-2"))
    assert f"resumed {out / 'checkpoint-2'} at step 2" in resumed
    again = losses(resumed)
    assert sorted(again) == [3, 4] and all(again[s] == trained[s] for s in again), (trained, again)

    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    assert exported.config.num_hidden_layers == 2
