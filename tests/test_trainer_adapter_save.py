"""``trainer.save_model(d)`` of a PEFT model at stage 3 gathers the adapter's units only (issue 27 item 4).

One ``accelerate launch`` of 2 CPU processes (tests/workers/trainer_adapter_save.py) trains
a LoRA on a tiny Llama at stage 3 (every parameter sharded) with ``ZeroTrainer`` and with
``zero_trainer(trl.SFTTrainer)``, and saves each with ``trainer.save_model(d)``; then one
plain process loads the trained adapter (read through ``model.state_dict()``, not the save)
into a plain LoRA model and saves it with the stock ``Trainer`` / ``SFTTrainer``. Here: the
same files (adapter weights and config, tokenizer, training arguments), the same tensors
bit for bit, and while saving no rank gathered more than one block's adapter: the frozen
base weights stayed sharded.

Before the change a PEFT model's ``save_model`` built ``full_state_dict(rank0_only=True)``,
the whole base model, for PEFT to keep the adapter of: measured, a gathered peak of one
block's base weights (37 KB here) instead of its adapter (1.8 KB), on both ranks.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("trl")

from _accelerate_launch import accelerate_launch, run_single  # noqa: E402

WORKER = "trainer_adapter_save.py"
CLASSES = ["trainer", "sft"]
PAD = 64 * 4  # a flat group is padded to a multiple of the world size


@functools.lru_cache(maxsize=None)
def runs():
    """(the directory both runs wrote into, the ZeRO run's per-rank reports)."""
    out = Path(tempfile.mkdtemp(prefix="zs_acc_"))
    reports, _ = accelerate_launch(WORKER, {"mode": "zero"}, timeout=300, out=out, use_cpu=False)
    log = run_single(WORKER, {"mode": "stock"}, out, timeout=240, use_cpu=False)
    assert (out / "stock.json").is_file(), log[-3000:]
    return out, reports


def _config(path) -> dict:
    """A JSON file's content; PEFT writes ``target_modules``, a set, in the process's hash order."""
    content = json.loads(path.read_text())
    if isinstance(content.get("target_modules"), list):
        content["target_modules"] = sorted(content["target_modules"])
    return content


@pytest.mark.multiprocess
@pytest.mark.parametrize("which", CLASSES)
def test_save_model_writes_the_stock_trainers_adapter_files(which):
    import torch
    from safetensors.torch import load_file

    out, reports = runs()
    assert all(r[which]["sharded"] and r[which]["stage"] == 3 for r in reports)
    got_dir, want_dir = out / f"zero_{which}", out / f"stock_{which}"
    names = sorted(p.name for p in want_dir.iterdir())
    assert sorted(p.name for p in got_dir.iterdir()) == names
    assert {"adapter_model.safetensors", "adapter_config.json", "training_args.bin", "tokenizer.json"} <= set(names)
    assert not any(n.startswith("model") for n in names)  # the adapter only, as stock
    for f in ("adapter_config.json", "tokenizer_config.json", "tokenizer.json"):
        if f in names:
            assert _config(got_dir / f) == _config(want_dir / f), f
    got, want = load_file(got_dir / "adapter_model.safetensors"), load_file(want_dir / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and want
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.multiprocess
@pytest.mark.parametrize("which", CLASSES)
def test_save_model_leaves_the_base_weights_sharded(which):
    _, reports = runs()
    for rank, r in enumerate(reports):
        res, sizes = r[which], r[which]["sizes"]
        print(f"save_model[{which}] rank {rank}: gathered peak {res['gathered']} bytes; a block's adapter is "
              f"{max(sizes['adapter'])}, its base weights {min(sizes['base'])}")
        assert 0 < res["gathered"] <= max(sizes["adapter"]) + PAD < min(sizes["base"]), (
            f"rank {rank}: {res['gathered']} bytes gathered at the peak")
        assert res["gathered_after"] == 0
