"""SLURM auto-requeue under ZeroStrategy, with a real SIGUSR1 and a save killed mid-way.

Issue 38: a save killed mid-way left ``hpc_ckpt_2.ckpt.tmp-<hex>``, and Lightning reads the
digits of every ``hpc_ckpt_`` name, so every requeued job died at start looking for
``hpc_ckpt_2012345.ckpt`` though ``hpc_ckpt_1.ckpt`` was complete; and during the SIGUSR1
save itself, a rank that scanned the folder after rank 0's save had begun picked another
name, so the save failed on both ranks and the job was not requeued. Three runs of one job
(tests/workers/lightning_requeue.py), each as srun starts it: the first saves at SIGUSR1 and
requeues; the second is killed in the middle of its SIGUSR1 save; the third must resume
from the last complete checkpoint, save again, and leave only complete checkpoints.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from _launch import launch_faulty  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _run(tmp_path: Path, name: str, **args) -> dict:
    out = tmp_path / name
    out.mkdir()
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    return launch_faulty("lightning_requeue.py", 2, dict(args, root=str(tmp_path / "root")), survivors=[0, 1],
                         out=out, timeout=150, env=env)


def _ok(result: dict) -> list[dict]:
    reports = [result["reports"][r] for r in (0, 1)]
    for r, rep in enumerate(reports):
        assert rep is not None and "error" not in rep, f"rank {r}: {rep}\n{result['logs'][r]}"
    return reports


@pytest.mark.timeout(600)
def test_a_requeued_job_resumes_from_the_last_complete_checkpoint_after_a_killed_save(tmp_path):
    from zero_strategy.lightning import read_lightning_state

    root, bin_dir = tmp_path / "root", tmp_path / "bin"
    root.mkdir()
    bin_dir.mkdir()
    calls = tmp_path / "scontrol_calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)

    first = _ok(_run(tmp_path, "first", max_steps=4, signal_at=2))
    assert [rep["environment"] for rep in first] == ["SLURMEnvironment"] * 2
    assert [(rep["start_step"], rep["end_step"]) for rep in first] == [(0, 4)] * 2
    assert calls.read_text().split("\n")[0] == "requeue 4242"  # Lightning requeued the job
    assert sorted(os.listdir(root)) == ["hpc_ckpt_1.ckpt"]

    killed = _run(tmp_path, "killed", max_steps=6, signal_at=4, kill_save=True)
    assert killed["codes"][0] == -9, f"rank 0 was not killed in its save:\n{killed['logs'][0]}"
    assert [p for p in os.listdir(root) if p != "hpc_ckpt_1.ckpt"], "the killed save left nothing to trip on"

    third = _ok(_run(tmp_path, "third", max_steps=5, signal_at=3))
    assert [(rep["start_step"], rep["end_step"]) for rep in third] == [(2, 5)] * 2  # from hpc_ckpt_1
    assert sorted(os.listdir(root)) == ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt"]  # the leftover removed
    assert read_lightning_state(root / "hpc_ckpt_2.ckpt")["global_step"] == 3
