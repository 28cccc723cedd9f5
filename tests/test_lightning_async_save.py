"""Lightning's idiom with ``async_save``: ``ModelCheckpoint`` (top-1 and last) through
``ZeroStrategy(async_save=True)`` writes the checkpoints a synchronous run writes, the end of
``fit`` leaves every one of them complete, and resuming from the asynchronous run's ``last.ckpt``
continues bit for bit as resuming from the synchronous run's, on 2 ranks.
"""

from __future__ import annotations

import filecmp

import pytest
import torch

from _launch import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SYNC = {"stage": 3}
ASYNC = {"stage": 3, "async_save": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_async")
    cases = [
        dict(name="sync", strategy=SYNC, epochs=2, ckpt_dir=str(root / "sync")),
        dict(name="async", strategy=ASYNC, epochs=2, ckpt_dir=str(root / "async")),
        dict(name="sync_resumed", strategy=SYNC, epochs=3, resume=str(root / "sync" / "last.ckpt")),
        dict(name="async_resumed", strategy=ASYNC, epochs=3, resume=str(root / "async" / "last.ckpt")),
    ]
    for c in cases:
        c["save_dir"] = str(root)
    reports = launch("lightning_trainer.py", 2, {"cases": cases}, timeout=300)
    for r in reports:
        for name, rep in r.items():
            assert "error" not in rep, f"{name}: {rep['error']}\n{rep.get('trace', '')}"
    return reports, root


def test_model_checkpoint_writes_the_synchronous_runs_checkpoints(runs):
    reports, root = runs
    assert reports[0]["sync"]["background_saves"] == 0 and reports[0]["async"]["background_saves"] == 4
    files = reports[0]["async"]["files"]
    assert files == reports[0]["sync"]["files"] and len(files) == 2, files  # top-1 (older deleted) + last
    assert sorted(p.name for p in (root / "async").iterdir()) == files  # nothing half-written after fit
    for ckpt in files:
        names = sorted(p.name for p in (root / "sync" / ckpt).iterdir())
        assert names == sorted(p.name for p in (root / "async" / ckpt).iterdir())
        for name in names:
            if name.endswith(".safetensors"):  # the shards (Lightning's blob names each run's own dirpath)
                assert filecmp.cmp(root / "sync" / ckpt / name, root / "async" / ckpt / name, shallow=False), name


def test_resuming_the_asynchronous_runs_checkpoint_continues_bit_for_bit(runs):
    reports, root = runs
    for r in reports:
        assert r["async"]["losses"] == r["sync"]["losses"]
        assert r["async_resumed"]["losses"] == r["sync_resumed"]["losses"]
        assert r["async_resumed"]["global_step"] == 6
    got, want = torch.load(root / "async_resumed.pt"), torch.load(root / "sync_resumed.pt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
