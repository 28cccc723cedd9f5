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
