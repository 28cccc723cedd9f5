"""One launch of workers/accounting.py per world size, shared by the memory and comm tests."""

from __future__ import annotations

import functools

from _launch import launch

CASES = [dict(stage=s, precision=p) for s in (1, 2, 3) for p in ("fp32", "bf16")]


@functools.lru_cache(maxsize=None)
def accounting(world_size: int) -> dict:
    """{(stage, precision): [result of each rank]} for CASES."""
    reports = launch("accounting.py", world_size, {"cases": CASES}, timeout=240)
    return {(r["case"]["stage"], r["case"]["precision"]): [rep["results"][i] for rep in reports]
            for i, r in enumerate(reports[0]["results"])}


ACCUM_CASES = [dict(stage=s, precision="fp32", accum=2, no_sync=q) for s in (1, 2, 3) for q in (True, False)]


@functools.lru_cache(maxsize=None)
def accounting_accumulation(world_size: int) -> dict:
    """{(stage, no_sync): [result of each rank]} for ACCUM_CASES (2 micro-batches per step)."""
    reports = launch("accounting.py", world_size, {"cases": ACCUM_CASES}, timeout=240)
    return {(r["case"]["stage"], r["case"]["no_sync"]): [rep["results"][i] for rep in reports]
            for i, r in enumerate(reports[0]["results"])}
