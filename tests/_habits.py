"""Shared by the seam tests that run users' own loops (tests/workers/habits.py) on 2 ranks."""

from __future__ import annotations

import functools

import pytest

from _launch import launch


@functools.lru_cache(maxsize=None)
def habit_reports(scenarios: tuple[str, ...], policies: tuple[tuple[int, str | None], ...]) -> list[dict]:
    """One launch runs every (scenario, stage, offload) case; each rank's report, cached."""
    cases = [dict(scenario=s, stage=stage, offload=off) for s in scenarios for stage, off in policies]
    return launch("habits.py", 2, {"cases": cases}, timeout=240)


def results_of(reports: list[dict], scenario: str):
    """(rank, result) of ``scenario`` on every rank and policy, failing on a worker error; each
    result already compared with the plain model: weights within 1e-5 relative, losses too."""
    found = 0
    for rank, rep in enumerate(reports):
        for res in rep["results"]:
            assert "error" not in res, res["error"]
            if res["case"]["scenario"] != scenario:
                continue
            found += 1
            assert res["weight_rel_diff"] < 1e-5, (rank, res["case"], res["weight_rel_diff"])
            assert res["losses_zero"] == pytest.approx(res["losses_ref"], rel=1e-5), res["case"]
            yield rank, res
    assert found, f"no result for {scenario}"
