"""`zero-strategy estimate` shows the working set and the peak beside the model states.

Oracle, by hand, for a 12-layer tied Llama (vocab 100, hidden 16, MLP 32) in bf16 on one rank:
a decoder layer is a unit of u = 4·16² + 3·16·32 + 2·16 = 2,592 parameters, the root (the tied
embedding and the final norm) r = 1,616, Ψ = r + 12u. Stage 3 gathers the root, the unit in
use and one prefetched: 2(r + 2u) bytes; stages 2-3 hold the root's gradients, 4 units' in
flight and the unit in backward: 2(r + 5u), less than the whole gradient 2Ψ here. The peak is
the ZeRO formula's 16Ψ (stage 3) or 2Ψ + 14Ψ (stage 2, N = 1) plus those. Without a model the
unit-dependent terms are shown as n/a, never guessed.
"""

from __future__ import annotations

import json

import pytest

from zero_strategy.cli import main
from test_cli_estimate import _tiny_llama_dir

UNIT, ROOT, LAYERS = 2592, 1616, 12
PSI = ROOT + LAYERS * UNIT


@pytest.mark.parametrize("stage, gathered", [(2, 0), (3, 2 * (ROOT + 2 * UNIT))])
def test_json_has_the_working_set_and_the_peak(capsys, tmp_path, stage, gathered):
    path = _tiny_llama_dir(tmp_path, layers=LAYERS)
    assert main(["estimate", "--model", str(path), "--stage", str(stage), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    buckets = 2 * (ROOT + 5 * UNIT)
    assert (row["units"], row["largest_unit_params"], row["root_params"]) == (LAYERS, UNIT, ROOT)
    assert (row["working_set_gathered"], row["working_set_grad_buckets"]) == (gathered, buckets)
    assert row["working_set_device"] == gathered + buckets
    assert row["peak_device"] == 16 * PSI + gathered + buckets
    assert row["peak_host"] == row["total_host"] == 0


def test_the_table_has_working_set_and_peak_columns(capsys, tmp_path):
    path = _tiny_llama_dir(tmp_path, layers=LAYERS)
    assert main(["estimate", "--model", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0]
    assert "dev work GiB" in header and "dev peak GiB" in header and "host peak GiB" in header
    zero3 = next(line for line in lines if line.startswith("ZeRO-3 "))
    assert "n/a" not in zero3
    assert any("units: 12, largest 2,592 parameters, root (outside units) 1,616" in line for line in lines)


def test_without_a_model_the_unit_terms_are_not_guessed(capsys):
    assert main(["estimate", "--params", "7e9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split("  ")[0].strip(): line for line in lines[2:10]}
    assert "n/a" not in rows["ZeRO-1"]  # its buckets are the full gradient: known without the model
    assert rows["ZeRO-3"].split()[-3:-1] == ["n/a", "n/a"]  # host peak (staging) is still known
    assert any("need the model's unit sizes: pass --model DIR" in line for line in lines)
    assert main(["estimate", "--params", "7e9", "--stage", "3", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["working_set_gathered"] is None and row["peak_device"] is None and row["peak_host"] == 0
