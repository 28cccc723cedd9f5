"""Lightning: an exception in ``training_step`` on one rank ends the whole job about as fast as
with ``strategy="ddp"``, at every stage, and the other rank's error quotes it.

Issue #15: it hung (30 minutes by default) because the failing rank's teardown
gathered the full weights while the healthy rank waited in a backward collective. The
oracle is DDP in the same script (tests/workers/lightning_fault.py), measured in the
same session: from the moment rank 1 raised to each process's exit. Lightning's process
group keeps its default 30-minute timeout and the strategy its default
collective_timeout (300 s), so only a teardown that starts no collective makes it.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from _launch import launch_faulty  # noqa: E402

SLACK = 20.0  # seconds beyond DDP's own exit time: process teardown on a loaded 2-core machine


@functools.lru_cache(maxsize=None)
def exit_times(strategy: str) -> tuple[dict, dict]:
    out = Path(tempfile.mkdtemp(prefix="zs_lightning_fault_"))
    result = launch_faulty("lightning_fault.py", 2, {"strategy": strategy}, survivors=[0, 1], out=out,
                           timeout=150)
    failed_at = float((out / "fail_time").read_text())
    seconds = {r: (t - failed_at if t is not None else None) for r, t in result["exited"].items()}
    return seconds, result


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["zero1", pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_an_exception_in_training_step_ends_the_job_as_fast_as_ddp(strategy):
    ddp, _ = exit_times("ddp")
    assert all(s is not None for s in ddp.values()), ddp  # the reference itself exits
    ours, result = exit_times(strategy)
    for rank in (0, 1):
        assert ours[rank] is not None, f"rank {rank} still running at 150 s:\n{result['logs'][rank]}"
        assert ours[rank] < max(ddp.values()) + SLACK, (ours, ddp)
    assert result["reports"][1]["error"] == "RuntimeError"  # the user's own error, not a collective's
    survivor = result["reports"][0]
    assert survivor["error"] == "CollectiveError", survivor
    assert "Group rank 1 reported: rank 1 raised RuntimeError: injected failure in training_step" in \
        survivor["message"]
    assert "step 3" in survivor["message"]
