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


OFFLOAD_CASES = [dict(stage=s, precision=p, offload_optimizer="cpu") for s in (1, 2, 3) for p in ("fp32", "bf16")]
OFFLOAD_CASES += [dict(stage=3, precision=p, offload_optimizer="cpu", offload_params="cpu") for p in ("fp32", "bf16")]


def _offload_key(case: dict) -> tuple:
    return (case["stage"], case["precision"], case.get("offload_params"))


@functools.lru_cache(maxsize=None)
def accounting_offload(world_size: int) -> dict:
    """{(stage, precision, offload_params): [result of each rank]} for OFFLOAD_CASES."""
    reports = launch("accounting.py", world_size, {"cases": OFFLOAD_CASES}, timeout=240)
    return {_offload_key(r["case"]): [rep["results"][i] for rep in reports]
            for i, r in enumerate(reports[0]["results"])}


RSS_CASES = [dict(stage=s, precision="fp32", width=1024, blocks=12) for s in (1, 2, 3)]
RSS_CASES += [dict(stage=3, precision="fp32", width=1024, blocks=12, offload_optimizer="cpu", offload_params="cpu")]


def _rss_key(case: dict) -> tuple:
    return (case["stage"], case.get("offload_params"))


@functools.lru_cache(maxsize=None)
def accounting_rss(world_size: int) -> dict:
    """{(stage, offload_params): [result of each rank]} for RSS_CASES: the process's anonymous RSS
    beside the engine's accounting, per phase (see workers/accounting.py's rss_case)."""
    reports = launch("accounting.py", world_size, {"cases": RSS_CASES, "rss": True}, timeout=240)
    return {_rss_key(r["case"]): [rep["results"][i] for rep in reports]
            for i, r in enumerate(reports[0]["results"])}
