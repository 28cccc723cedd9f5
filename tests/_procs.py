"""How the tests start interpreters: one environment, one port, one cold start, one report reader.

Every launcher in tests/ (``_launch.launch``, ``_accelerate_launch.accelerate_launch``, the
recipe, CLI, Lightning-script and multi-node runs) builds on these, so:

* :func:`child_env` is the one place ``PYTHONPATH`` is assembled: this checkout's ``src``
  first (never an installed copy of the package), then ``tests/`` (the shared helpers
  and models), then whatever the caller had; ``OMP_NUM_THREADS=1``.
* :func:`start` / :func:`run` start a command in its own session, so a timeout kills the
  whole process group: a launcher (torchrun, ``accelerate launch``) and every rank it
  started, never leaving a rank behind. Everything has a timeout.
* :func:`note_launch_time`: every launch's elapsed time beside its limit goes to the session's
  record (``ZS_TEST_LAUNCH_TIMES``, set by tests/conftest.py), whose summary names the launches
  nearest their limits, so a limit is sized from what the launch took on a loaded machine.
* :func:`read_reports`: ranks are judged by the ``<out>/rank<r>.json`` each writes, not only
  by exit codes, because ~30% of 2-rank CPU runs abort in interpreter teardown after
  finishing their work; workers end with ``destroy_process_group(); os._exit(0)``
  (tests/workers/_worker.py ``finish``).

The warm start (ranks forked from a forkserver that imported torch once) is
tests/_launch.py's; ``ZS_TEST_COLD_START=1`` makes it use :func:`start` instead.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = ROOT / "src"

# what a launcher sets per rank: a child must not inherit the test process's own (a test run
# under torchrun, or a variable a test set), or it joins the wrong group
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# what our front ends read from the environment before their config: a child that runs a user's
# script or a launch must not inherit a value a test set for itself
FRONT_END_VARS = ("ZERO_STRATEGY_CONFIG", "ZERO_STRATEGY_ADOPTED_DEEPSPEED_LAUNCH", "ZERO_STRATEGY_LOG_ALL_RANKS",
                  "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_CPU")


def pythonpath() -> str:
    """This checkout's ``src`` and ``tests/`` ahead of the caller's ``PYTHONPATH``."""
    parts = [str(SRC), str(HERE), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


def child_env(drop: tuple[str, ...] = (), **extra: str) -> dict:
    """The environment of a child interpreter: this process's, less ``drop``, with :func:`pythonpath`,
    ``OMP_NUM_THREADS=1`` and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=pythonpath())
    env.update(extra)
    return env


# [Note: launch ports]
# A launch is handed its rendezvous port before its rank 0 binds it, so a port must stay free in
# between. The kernel's choice (bind to port 0) is a port of the ephemeral range, the same range
# every outgoing connection takes its local port from: under ``-n 3`` the gloo connections of the
# other workers' launches (hundreds per launch) could take it in that gap, and a launch's ranks
# then met a socket that was not their store ("Connection closed by peer"). So ports come from
# below the ephemeral range, which the kernel never hands out by itself, and each pytest worker
# draws from its own slice, in turn from a start that differs per process (two sessions on one
# machine rarely meet), skipping any port that is in use now.
PORTS_BELOW = 20000  # the lowest port handed out; the slices end where the ephemeral range starts
_next_port: list[int] = []


def _port_slice() -> range:
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    top = max(ephemeral_low, PORTS_BELOW + 1024)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0) % workers
    width = (top - PORTS_BELOW) // workers
    return range(PORTS_BELOW + worker * width, PORTS_BELOW + (worker + 1) * width)


def free_port() -> int:
    """A port free now and not handed to any other launch of this session. See [Note: launch ports]."""
    ports = _port_slice()
    if not _next_port:
        _next_port.append(os.getpid() * 7919 % len(ports))
    for _ in range(len(ports)):
        port = ports[_next_port[0] % len(ports)]
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: the next one
            return port
    raise AssertionError(f"no free port in {ports.start}-{ports.stop - 1}")


def start(cmd: list[str], env: dict | None = None, cwd: Path | str = ROOT, stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT, text: bool = True) -> subprocess.Popen:
    """``cmd`` in a session (process group) of its own; ``env`` defaults to :func:`child_env`."""
    return subprocess.Popen(cmd, env=child_env() if env is None else env, cwd=cwd, stdout=stdout, stderr=stderr,
                            text=text, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (what :func:`start` made): the process and all it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(cmd: list[str], timeout: float, env: dict | None = None, cwd: Path | str = ROOT,
        merge_stderr: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion (:func:`start`), capturing its output as text.

    A run that outlives ``timeout`` has its whole process group killed and fails with the
    output's tail; whatever the command left running when it returned is killed too.
    ``merge_stderr``: stderr into stdout (one log in order).
    """
    what = " ".join(Path(str(a)).name if os.sep in str(a) else str(a) for a in cmd[:4])[:80]  # a -c program: its start
    started = time.monotonic()
    proc = start(cmd, env, cwd, stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        note_launch_time(what, timeout, time.monotonic() - started, killed=True)
        raise AssertionError(f"{' '.join(map(str, cmd[-12:]))} did not finish in {timeout}s:\n"
                             f"{(out + (err or ''))[-4000:]}") from None
    finally:
        kill_group(proc)
    note_launch_time(what, timeout, time.monotonic() - started)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "" if merge_stderr else err)


LAUNCH_TIMES = "ZS_TEST_LAUNCH_TIMES"  # the session's record of launch times (tests/conftest.py)


def note_launch_time(what: str, limit: float, elapsed: float, killed: bool = False, test: str | None = None) -> None:
    """Append one launch's ``elapsed`` seconds beside its ``limit`` to the session's record, a JSON
    line per launch (one ``write`` of a short line to a file opened for appending, so the
    pytest workers' lines never mix). Without a record (a test run outside pytest) it does nothing."""
    path = os.environ.get(LAUNCH_TIMES)
    if not path:
        return
    if test is None:  # the test running now (pytest names it in the environment during each phase)
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    line = json.dumps({"test": test, "what": what,
                       "limit": limit, "elapsed": round(elapsed, 1), "killed": killed,
                       "load": round(os.getloadavg()[0], 2)})
    with open(path, "a") as f:
        f.write(line + "\n")


def read_reports(out: Path, ranks: int, what: str, log: str | None = None) -> list[dict]:
    """Each rank's ``<out>/rank<r>.json``, in rank order; a rank that wrote none fails the run with
    ``log``'s tail (by default that rank's ``<out>/rank<r>.log``)."""
    reports = []
    for rank in range(ranks):
        path = out / f"rank{rank}.json"
        if not path.exists():
            if log is None:
                rank_log = out / f"rank{rank}.log"
                tail = rank_log.read_text()[-6000:] if rank_log.exists() else "(no log)"
            else:
                tail = log[-6000:]
            raise AssertionError(f"rank {rank} of {what} reported nothing:\n{tail}")
        reports.append(json.loads(path.read_text()))
    return reports
