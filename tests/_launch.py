"""Start N gloo ranks of a worker script and collect what each rank reports.

Each rank writes ``<out>/rank<r>.json``; success is judged by those reports, not
only by exit codes, because ~30% of 2-rank CPU runs abort in interpreter teardown
after finishing their work (see ../shared/ANCHORS.md). A run that does not finish
within ``timeout`` is killed, so a hang fails the test instead of hanging CI. The
run's temporary directory is removed afterwards (the logs travel in the error message).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: str, world_size: int, args: dict, timeout: float = 240.0, out: Path | None = None) -> list[dict]:
    """Run ``tests/workers/<worker>`` on ``world_size`` ranks; return each rank's JSON report.

    ``out``: a directory the caller owns (pytest's ``tmp_path``) when the test reads files the
    workers wrote there; it is kept. Without it a temporary directory is made and removed.
    """
    if out is not None:
        return _run(worker, world_size, args, timeout, Path(out))
    out = Path(tempfile.mkdtemp(prefix="zs_test_"))
    try:
        return _run(worker, world_size, args, timeout, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _run(worker: str, world_size: int, args: dict, timeout: float, out: Path) -> list[dict]:
    (out / "args.json").write_text(json.dumps(args))
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")]))
        log = open(out / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(HERE / "workers" / worker), str(out)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout
    for p, log in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(world_size))
            raise AssertionError(f"{worker} on {world_size} ranks did not finish in {timeout}s:\n{logs}")
        finally:
            log.close()
    reports = []
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        if not path.exists():
            logs = (out / f"rank{rank}.log").read_text()[-6000:]
            raise AssertionError(f"rank {rank} of {worker} reported nothing:\n{logs}")
        reports.append(json.loads(path.read_text()))
    return reports


def launch_faulty(worker: str, world_size: int, args: dict, survivors: list[int], out: Path,
                  timeout: float = 120.0, env: dict | None = None) -> dict:
    """Run a worker in which some rank misbehaves; wait only for the ``survivors`` to exit.

    Returns ``{"reports": {rank: report or None}, "exited": {rank: time.time() of exit or None},
    "codes": {rank: exit code}, "logs": {rank: log tail}}``; ranks still running when the
    survivors are done (a stuck rank) or at ``timeout`` are killed, so nothing is left behind.
    """
    (out / "args.json").write_text(json.dumps(args))
    port = free_port()
    procs = {}
    for rank in range(world_size):
        penv = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join([str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")]),
                    **(env or {}))
        log = open(out / f"rank{rank}.log", "w")
        procs[rank] = (subprocess.Popen([sys.executable, str(HERE / "workers" / worker), str(out)],
                                        env=penv, stdout=log, stderr=subprocess.STDOUT), log)
    deadline = time.monotonic() + timeout
    exited: dict[int, float | None] = {r: None for r in procs}
    try:
        while time.monotonic() < deadline and any(exited[r] is None for r in survivors):
            for r, (p, _) in procs.items():
                if exited[r] is None and p.poll() is not None:
                    exited[r] = time.time()
            time.sleep(0.05)
    finally:
        for r, (p, log) in procs.items():
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    reports = {r: (json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None)
               for r in procs}
    logs = {r: (out / f"rank{r}.log").read_text()[-4000:] for r in procs}
    return dict(reports=reports, exited=exited, codes={r: p.returncode for r, (p, _) in procs.items()}, logs=logs)
