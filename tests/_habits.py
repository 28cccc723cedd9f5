"""Shared by the seam tests: users' own loops on 2 ranks (tests/workers/habits.py), and the
one-process comparison of a set-up model with a plain one."""

from __future__ import annotations

import functools

import torch

import zero_strategy as zs
from _models import batch, loss_fn


@functools.lru_cache(maxsize=None)
def habit_reports(scenarios: tuple[str, ...], policies: tuple[tuple[int, str | None], ...]) -> list[dict]:
    """One launch runs every (scenario, stage, offload) case; each rank's report, cached."""
    from _launch import launch  # here: the one-process helpers below start nothing (tests/test_markers.py)

    cases = [dict(scenario=s, stage=stage, offload=off) for s in scenarios for stage, off in policies]
    return launch("habits.py", 2, {"cases": cases}, timeout=240)


def results_of(reports: list[dict], scenario: str) -> list[tuple[int, dict]]:
    """(rank, result) of ``scenario`` on every rank and policy, in launch order; a worker error in
    any case fails here. The test asserts what each result must show (weights and losses against
    the plain model the worker trained beside it)."""
    found = []
    for rank, rep in enumerate(reports):
        for res in rep["results"]:
            assert "error" not in res, res["error"]
            if res["case"]["scenario"] == scenario:
                found.append((rank, res))
    return found


def train(model, optimizer, steps) -> None:
    """The plain loop on this process's batches: forward, backward, step, zero_grad."""
    for step in steps:
        tokens, targets = batch(0, step, 0)
        loss_fn(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def assert_same_weights(model, plain, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """The set-up ``model``'s full weights equal the plain reference's, tensor by tensor."""
    full = zs.full_state_dict(model)
    for key, ref in plain.state_dict().items():
        torch.testing.assert_close(full[key], ref, rtol=rtol, atol=atol, msg=key)
