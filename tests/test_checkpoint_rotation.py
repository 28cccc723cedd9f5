"""Rotation of old checkpoints never costs the last good one to a failed asynchronous save.

The HF Trainer's ``save_total_limit``, Accelerate's ``ProjectConfiguration(total_limit=...)`` and
Lightning's ``ModelCheckpoint(save_top_k=...)`` delete old checkpoints around each save; with ``async_save`` the save has returned before its
shards are written. One rank (tests/workers/checkpoint_rotation.py), every write held a moment so
the rotation comes while the save writes: when the write of the newest checkpoint fails, the
previous one is still there and resumes; when none fails, exactly ``limit`` checkpoints remain.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _launch import launch_cases  # noqa: E402

FAIL_AT = {"hf": "checkpoint-3", "accelerate": "checkpoint_1", "lightning": "epoch=0-step=3.ckpt"}


@functools.lru_cache(maxsize=None)
def _results(front_end: str):
    """One process per front end runs both cases: no failure, and the newest write failing."""
    cases = [{"case": name, "front_end": front_end, "fail_at": fail_at}
             for name, fail_at in (("ok", None), ("fail", FAIL_AT[front_end]))]
    return launch_cases("checkpoint_rotation.py", 1, cases, key=lambda r: r["case"], timeout=180)


def _run(front_end: str, case: str) -> dict:
    (report,) = _results(front_end).of(case)
    return report


@pytest.mark.multiprocess
@pytest.mark.slow  # three trainers, one resumed
def test_hf_save_total_limit_keeps_the_previous_checkpoint_when_the_newest_write_fails():
    r = _run("hf", "fail")
    assert "No space left on device" in r["save_error"]
    assert "checkpoint-2" in r["left"]  # before: rotated away while checkpoint-3 was still writing
    assert r["resumed_steps"] == [3]  # resumed after step 2


@pytest.mark.multiprocess
@pytest.mark.slow  # the same launch as above
def test_hf_save_total_limit_still_rotates_after_asynchronous_saves():
    r = _run("hf", "ok")
    assert "save_error" not in r and r["left"] == ["checkpoint-3"]


@pytest.mark.multiprocess
def test_accelerate_total_limit_keeps_the_previous_checkpoint_when_the_newest_write_fails():
    r = _run("accelerate", "fail")
    assert "No space left on device" in r["save_error"]
    assert "checkpoint_0" in r["left"] and r["loaded"]  # before: deleted by the next save_state


@pytest.mark.multiprocess
def test_accelerate_total_limit_still_rotates_after_asynchronous_saves():
    r = _run("accelerate", "ok")
    assert "save_error" not in r and r["left"] == ["checkpoint_2"]


@pytest.mark.multiprocess
@pytest.mark.slow  # two fits, one resumed
def test_lightning_save_top_k_keeps_the_previous_checkpoint_when_the_newest_write_fails():
    r = _run("lightning", "fail")
    assert "No space left on device" in r["save_error"]
    assert "epoch=0-step=2.ckpt" in r["left"] and r["resumed_global_step"] == 3


@pytest.mark.multiprocess
@pytest.mark.slow  # the same launch as above
def test_lightning_save_top_k_still_removes_after_asynchronous_saves():
    r = _run("lightning", "ok")
    assert "save_error" not in r and r["left"] == ["epoch=0-step=3.ckpt"]
