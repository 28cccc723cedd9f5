"""A collective whose result is read before its wait() would be a race on GPUs.

Here every async all-gather / reduce-scatter is deferred: its output is filled with
NaN at launch and the communication happens only inside ``wait()``. Any read of an
output before its wait (or a wait that never comes) then yields NaN or stale data,
deterministically, and the run no longer matches DDP.
"""

from __future__ import annotations

import pytest

from _launch import launch

CASES = [dict(stage=s, precision=p, accum=a, defer=True, optimizer="sgd")
         for s in (1, 2, 3) for p in ("fp32", "bf16") for a in (1, 2)]
CASES.append(dict(stage=3, precision="fp32", accum=1, defer=True, persistence=200))


@pytest.mark.multiprocess
def test_deferred_collectives_still_match_ddp():
    reports = launch("parity.py", 2, {"cases": CASES}, timeout=240)
    for rank, rep in enumerate(reports):
        assert len(rep["results"]) == len(CASES)
        for res in rep["results"]:
            assert "error" not in res, res["error"]
            assert res["losses_zero"] == pytest.approx(res["losses_ref"], rel=1e-5), res["case"]
            assert res["weight_rel_diff"] <= 1e-5, (rank, res["case"], res["worst_tensor"])
