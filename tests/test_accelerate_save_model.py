"""``accelerator.save_model`` at stage 3 writes stock Accelerate's files, one unit at a time (issue 27 item 4).

One ``accelerate launch`` of 2 CPU processes (tests/workers/accelerate_save_model.py) trains
a tiny Llama (6 blocks of 5.5 MB fp32, tied embeddings, two buffers of its own) with a
ZeroAccelerator at stage 3 and saves it with ``save_model`` whole and split at 8 MB; one
plain process trains the same model with stock ``accelerate.Accelerator`` on the same
global batches and saves it with stock ``save_model``. Here: the same file names, index,
keys, dtypes and shapes as stock's, values within fp32 exactness of stock's and bit-equal
to ``get_state_dict``; while saving, the main process gathered no more than one unit at a
time and the other gathered nothing, only sending its shards (the engine's working set),
and the process that writes nothing grew by far less than the model (its own peak
resident memory).

Before the change ``save_model`` went through ``get_state_dict``, so the main process
held the whole model's fp32 copy on the host before writing. Measured (torch 2.13 CPU, accelerate
1.16): the main process's peak RSS +35.9 MiB for this 31.8 MiB model before, +10.4 MiB after;
5.25 MiB (one block's fp32 group) gathered at the peak on both.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _accelerate_launch import accelerate_launch, run_single  # noqa: E402

WORKER = "accelerate_save_model.py"
SAVES = ["whole", "split"]
TOL = 1e-5  # fp32: relative to each tensor's largest magnitude (tests/_compare.py)
PAD = 64 * 4  # a flat group is padded to a multiple of the world size
SLACK = 12 << 20  # Python, torch and safetensors working memory beside the tensors


@functools.lru_cache(maxsize=None)
def runs():
    """(ZeRO run's directory, its per-rank reports, the stock run's directory)."""
    out, stock = Path(tempfile.mkdtemp(prefix="zs_acc_")), Path(tempfile.mkdtemp(prefix="zs_acc1_"))
    reports, _ = accelerate_launch(WORKER, {"mode": "zero"}, timeout=300, out=out, use_cpu=False)
    stock_log = run_single(WORKER, {"mode": "stock"}, stock, timeout=240, use_cpu=False)
    assert (stock / "rank0.json").is_file(), stock_log[-3000:]
    return out, sorted(reports, key=lambda r: r["rank"]), stock


def files(directory):
    return sorted(p.name for p in directory.iterdir())


def tensors(directory) -> dict:
    from safetensors.torch import load_file

    return {f.name: load_file(f) for f in sorted(directory.glob("*.safetensors"))}


@pytest.mark.multiprocess
@pytest.mark.parametrize("save", SAVES)
def test_save_model_writes_stock_accelerates_files(save):
    from _compare import tensor_rel_diff

    out, reports, stock = runs()
    got_dir, want_dir = out / f"zero_{save}", stock / f"stock_{save}"
    assert files(got_dir) == files(want_dir)
    if save == "split":
        assert len(files(want_dir)) > 2 and "model.safetensors.index.json" in files(want_dir)
        got_index = json.loads((got_dir / "model.safetensors.index.json").read_text())
        assert got_index == json.loads((want_dir / "model.safetensors.index.json").read_text())
    else:
        assert files(want_dir) == ["model.safetensors"]
    got, want = tensors(got_dir), tensors(want_dir)
    for name in want:
        assert sorted(got[name]) == sorted(want[name]), name
        for k, v in want[name].items():
            assert got[name][k].dtype == v.dtype and got[name][k].shape == v.shape, k
            assert tensor_rel_diff(got[name][k], v) < TOL, f"{k}: {tensor_rel_diff(got[name][k], v):.2e}"
    keys = {k for t in got.values() for k in t}
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # tied: the first name kept
    assert {"seen", "model.scale"} <= keys
    assert reports[0][save]["vs_get_state_dict"] == {"extra": [], "missing": [], "unequal": []}


@pytest.mark.multiprocess
@pytest.mark.parametrize("save", SAVES)
def test_save_model_gathers_one_unit_at_a_time(save):
    _, reports, _ = runs()
    sizes = reports[0]["sizes"]
    unit, model = max(sizes["blocks"] + [sizes["root"]]), sizes["model"]
    for r in reports:
        m = r[save]
        print(f"save_model[{save}] rank {r['rank']}: gathered peak {m['gathered'] / 2**20:.2f} MiB, "
              f"peak RSS +{m['rss'] / 2**20:.1f} MiB (model {model / 2**20:.1f} MiB)")
        assert m["gathered_after"] == 0
    gathered = reports[0][save]["gathered"]
    assert 0 < gathered <= unit + PAD, f"rank 0: {gathered} bytes gathered; a unit is {unit}"
    assert reports[1][save]["gathered"] == 0, "the rank that writes nothing only sends its shards to rank 0"
    assert reports[1][save]["rss"] < unit // 2 + SLACK < model, "the rank that writes nothing held a full copy"
    assert reports[0][save]["rss"] < 2 * unit + SLACK < model, "the writing rank held a full copy"
