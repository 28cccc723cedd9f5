"""What every worker does first and last: join the gloo group, run its cases, report, exit cleanly."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from _compare import worst_rel_diff  # noqa: F401 - the workers' comparison (tests/_compare.py)


def start() -> tuple[dict, Path]:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    if int(os.environ["WORLD_SIZE"]) > 1 or args.get("always_init", True):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    return args, out


def run_cases(cases: list, run: Callable[[object], dict], key: str = "case") -> list[dict]:
    """``run(case)`` for each case; the first failure is reported as ``{key: case[key], "error": traceback}``
    and ends the loop, so the ranks stay in lock-step and the test shows the traceback."""
    results = []
    for case in cases:
        try:
            results.append(run(case))
        except Exception:  # noqa: BLE001 - reported to the test
            # a case dict that has ``key`` is named by it, so the test's lookup finds the traceback
            name = case[key] if isinstance(case, dict) and key in case else case
            results.append({key: name, "error": traceback.format_exc()})
            print(traceback.format_exc(), file=sys.stderr)
            break
    return results


def run_named_cases(cases: list, run: Callable[[dict], dict], barrier: bool = False) -> dict:
    """``{case["name"]: run(case)}``; a failing case reports its error and the next cases still run
    (each builds its own Trainer/Fabric). ``barrier``: all ranks finish a case before the next starts."""
    reports = {}
    for case in cases:
        try:
            reports[case["name"]] = run(case)
        except Exception as err:  # noqa: BLE001 - reported to the test
            reports[case["name"]] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}
        if barrier:
            dist.barrier()
    return reports


def finish(out: Path, report: dict) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(out / f"rank{rank}.json")
    import gc
    gc.collect()  # set-up models collected: their NVMe swap files are removed before os._exit
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class LogLines(logging.Handler):
    """Collects the messages of a logger it is added to (``logging.getLogger("zero_strategy")``)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())
