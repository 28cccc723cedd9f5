"""Trainer checkpoints through the sharded format: ModelCheckpoint (top-k, last), resume on
2 ranks and on 1 (another stage too) equal to an uninterrupted fit, weights-only files
after fit, and one consolidated file for LightningModule.load_from_checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from _launch import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _lit_lm():
    """The workers' LightningModule, imported without leaving tests/workers on this worker's sys.path,
    where tests/workers/lightning_fabric.py would stand in for the real ``lightning_fabric`` package
    (See [Note: a fresh interpreter's sys.path] in tests/_launch.py for the processes it forks)."""
    workers = str(Path(__file__).parent / "workers")
    sys.path.insert(0, workers)
    try:
        from lightning_trainer import LitLM
    finally:
        sys.path.remove(workers)
    return LitLM


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_ckpt")
    ckpt = root / "ckpts"
    two = [
        dict(name="uninterrupted", strategy="zero3", epochs=3, save_weights_only=str(root / "plain.ckpt")),
        dict(name="first", strategy="zero3", epochs=2, ckpt_dir=str(ckpt)),
        dict(name="resumed", strategy="zero3", epochs=3, resume=str(ckpt / "last.ckpt")),
    ]
    one = [dict(name="resumed_1rank_zero2", strategy="zero2", epochs=3, batch=8, resume=str(ckpt / "last.ckpt"))]
    for c in two + one:
        c["save_dir"] = str(root)
    reports2 = launch("lightning_trainer.py", 2, {"cases": two}, timeout=200)
    reports1 = launch("lightning_trainer.py", 1, {"cases": one}, timeout=200)
    for reports in (reports2, reports1):
        for r in reports:
            for name, rep in r.items():
                assert "error" not in rep, f"{name}: {rep['error']}\n{rep.get('trace', '')}"
    return reports2, reports1, root


def _load(root, name):
    return torch.load(root / f"{name}.pt")


def _assert_close(a, b, rtol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")


def test_model_checkpoint_writes_directories_and_deletes_old_top_k(runs):
    reports2, _, root = runs
    files = reports2[0]["first"]["files"]
    assert len(files) == 2 and "last.ckpt" in files, files  # top-1 (the older one was deleted) + last
    for f in files:
        assert (root / "ckpts" / f / "metadata.json").is_file()
    assert sorted(p.name for p in (root / "ckpts").iterdir()) == files  # no temporary or moved-aside directory


def test_resume_equals_uninterrupted_fit(runs):
    reports2, _, root = runs
    for r in reports2:
        assert r["resumed"]["global_step"] == r["uninterrupted"]["global_step"] == 6
        assert r["resumed"]["losses"] == pytest.approx(r["uninterrupted"]["losses"][4:], rel=1e-6)
    _assert_close(_load(root, "resumed"), _load(root, "uninterrupted"), rtol=1e-6)


def test_resume_on_one_rank_with_another_stage(runs):
    _, reports1, root = runs
    assert reports1[0]["resumed_1rank_zero2"]["global_step"] == 6
    _assert_close(_load(root, "resumed_1rank_zero2"), _load(root, "uninterrupted"), rtol=1e-5)


def test_consolidated_file_loads_with_load_from_checkpoint(runs, tmp_path):
    _, _, root = runs
    LitLM = _lit_lm()
    from zero_strategy.lightning import convert_to_lightning_checkpoint, read_lightning_state

    state = read_lightning_state(root / "ckpts" / "last.ckpt")
    assert state["global_step"] == 4 and state["epoch"] == 1 and state["hyper_parameters"] == {"lr": 3e-3}
    out = convert_to_lightning_checkpoint(root / "ckpts" / "last.ckpt", tmp_path / "full.ckpt")
    model = LitLM.load_from_checkpoint(out)
    _assert_close({k: v.float() for k, v in model.state_dict().items()}, _load(root, "first"), rtol=0)


def test_weights_only_after_fit_is_a_plain_checkpoint(runs):
    _, _, root = runs
    LitLM = _lit_lm()

    plain = torch.load(root / "plain.ckpt", weights_only=False)
    assert "optimizer_states" not in plain
    model = LitLM.load_from_checkpoint(root / "plain.ckpt")
    _assert_close({k: v.float() for k, v in model.state_dict().items()}, _load(root, "uninterrupted"), rtol=0)
