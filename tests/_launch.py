"""Start N gloo ranks of a worker script and collect what each rank reports.

Each rank writes ``<out>/rank<r>.json``; success is judged by those reports, not
only by exit codes, because ~30% of 2-rank CPU runs abort in interpreter teardown
after finishing their work (gloo teardown). A run that does not finish
within ``timeout`` is killed, so a hang fails the test instead of hanging CI. The
run's temporary directory is removed afterwards (the logs travel in the error message).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _procs
from _procs import HERE, free_port


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


class CaseResults:
    """Each rank's result per case of one launch of a ``run_cases`` worker, or the launch's own
    failure, kept as they are: a test function caches this (``functools.lru_cache``) and each
    test asserts its own case with :meth:`of`, so a failing case fails its own test only, and
    the worker runs once, not once per parametrised case (``lru_cache`` does not cache an
    assertion raised inside it)."""

    def __init__(self, by_case: dict[str, list[dict]], world_size: int, failure: str | None = None):
        self.by_case, self.world_size, self.failure = by_case, world_size, failure

    def of(self, key: str) -> list[dict]:
        """Every rank's result of case ``key``, in rank order; raises with the rank's traceback."""
        if self.failure is not None:
            raise AssertionError(self.failure)
        got = self.by_case.get(key, [])
        for rank, res in enumerate(got):
            assert "error" not in res, f"rank {rank}, case {key}:\n{res['error']}"
        assert len(got) == self.world_size, (
            f"case {key} finished on {len(got)} of {self.world_size} ranks: a case before it failed (its test "
            "shows the traceback), and the worker stops at the first failure")
        return got


def launch_named_cases_with_nvme(worker: str, cases: list[dict], prefix: str, timeout: float) -> CaseResults:
    """:func:`launch_cases` on 2 ranks, each case given one fresh swap directory (``nvme_path``, removed
    after the run) and its results keyed by ``name``."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix=prefix) as nvme:
        return launch_cases(worker, 2, [dict(c, nvme_path=nvme) for c in cases], key=lambda r: r["name"],
                            timeout=timeout)


def launch_cases(worker: str, world_size: int, cases: list, key, timeout: float = 240.0) -> CaseResults:
    """:func:`launch` with ``{"cases": cases}``; ``key(result)`` names each result's case."""
    try:
        reports = launch(worker, world_size, {"cases": cases}, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - kept for every test of this launch to report
        return CaseResults({}, world_size, failure=f"{worker} on {world_size} ranks: {type(e).__name__}: {e}")
    by_case: dict[str, list[dict]] = {}
    for rep in reports:
        for res in rep["results"]:
            by_case.setdefault(key(res), []).append(res)
    return CaseResults(by_case, world_size)


# [Note: warm worker start]
# A worker process used to start as a fresh interpreter and spend ~2 s of CPU importing
# torch before anything else; with 2 ranks on 2 cores and over a hundred launches that
# was minutes of the suite. Ranks now fork from a forkserver that imported torch once
# (with OMP_NUM_THREADS=1, which OpenMP reads when torch loads it): the same script runs
# as __main__ via runpy with the same environment, argv, sys.path, log file and kill on
# timeout. Preloaded (PRELOADED): torch and torch._dynamo, which every worker imports anyway
# (zero_strategy's hooks are torch.compiler.disable boundaries, which import dynamo), and
# transformers' model and Trainer modules (with Accelerate, which the Trainer imports): about
# 3 s more of CPU per rank of every Hugging Face worker, and forked pages cost the others
# nothing. None of them reads at import anything a launch sets per rank (checked by recording
# every environment read during the imports: only Hugging Face's cache, hub and logging
# settings, which a launch inherits unchanged). Lightning (``lightning.pytorch``, which imports
# ``lightning.fabric``) is preloaded too, for the ranks of the Lightning launches: it reads one thing
# a launch sets, the rank, once at import (``rank_zero_only.rank``, from RANK, LOCAL_RANK,
# SLURM_PROCID or JSM_NAMESPACE_RANK), so each forked rank sets it again from its own environment
# before its script runs, as its own import would have (:func:`_as_if_imported_here`); its other
# reads (warning filters, logger and matplotlib settings, HOME) a launch inherits unchanged.
# zero_strategy is not preloaded (a worker that counts collectives wraps them before importing it),
# nor the separate ``pytorch_lightning`` package. The import-order tests (what importing
# zero_strategy or the Lightning hook pulls in) run their own subprocess.
# ZS_TEST_COLD_START=1 restores the fresh-interpreter start.
#
# [Note: the inherited heap out of the collector's sight]
# A forked process shares the forkserver's pages until it writes to one, and a full garbage collection
# writes to the header of every object it examines: each worker's ``gc.collect()`` in ``finish`` (and
# the memory workers' before their samples) made the rank copy the whole heap it inherited, the
# millions of objects the preloaded imports made. So a forked process first moves what it inherited
# into the collector's permanent generation (``gc.freeze()``: constant time, it touches no object),
# which collections skip; what the process creates itself is collected as before, and the imports'
# objects live as long as the process anyway. Measured on 2026-12-07, a 2-rank launch of
# test_parity_ddp.py's cases: 51,400 page faults per rank before, 17,300 after (134 MiB less copied),
# and 0.35 s less CPU per rank; a ``gc.collect()`` right after the fork took 0.4 s, after the freeze
# 0.3 ms. ``gc.get_objects()`` no longer lists the inherited objects (nothing the process made is
# hidden). tests/_zygote.py's processes do the same.
_WARM = os.environ.get("ZS_TEST_COLD_START") != "1"
PRELOADED = ["torch", "torch._dynamo", "transformers.modeling_utils", "transformers.trainer", "lightning.pytorch"]


def _as_if_imported_here() -> None:
    """In a forked process, after its environment is set: redo what a preloaded module read at import
    from a variable the launch sets (see [Note: warm worker start]): Lightning's rank, and
    huggingface_hub's settings (``HF_HUB_OFFLINE``, ``HF_HOME`` and the cache paths), which a recipe's
    or a user's command sets for itself. ``huggingface_hub.constants`` is re-run in place, so the
    functions that read its globals (``is_offline_mode``, used by transformers) and every
    ``constants.X`` read see the command's values."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:
        rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0
    hub_constants = sys.modules.get("huggingface_hub.constants")
    if hub_constants is not None:
        importlib.reload(hub_constants)
_FORKSERVER = None


def _forkserver():
    global _FORKSERVER
    if _FORKSERVER is None:
        import multiprocessing
        import multiprocessing.forkserver
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOADED)
        import multiprocessing.util
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"  # the server's environment at start: OpenMP reads it at load
        session_tmp = tempfile.tempdir  # conftest's per-session directory, made inside the usual one
        tempfile.tempdir = os.path.dirname(session_tmp) if session_tmp else None
        try:
            # its socket directory outside the session's temporary directory, which conftest
            # removes before multiprocessing's own exit-time cleanup of that directory runs
            multiprocessing.util.get_temp_dir()
            multiprocessing.forkserver.ensure_running()
        finally:
            tempfile.tempdir = session_tmp
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _FORKSERVER = ctx
    return _FORKSERVER


# [Note: a fresh interpreter's sys.path]
# A process forked from the forkserver takes the sys.path of the process that asked for it
# (multiprocessing's preparation data): a pytest worker's, which holds whatever the collected test
# modules put there (tests/workers, recipes/). A fresh interpreter has none of it, and there
# tests/workers/lightning_fabric.py stood in for the real ``lightning_fabric`` package whenever a
# module had put tests/workers on the worker's path. So a warm process starts from the path a fresh
# interpreter of this Python has (:func:`interpreter_path`, asked once per pytest worker), with the
# script's directory and PYTHONPATH in front, as ``python SCRIPT`` would; tests/_zygote.py's
# processes the same.
_INTERPRETER_PATH: list[str] = []


def interpreter_path() -> list[str]:
    """``sys.path`` of a fresh interpreter of this Python without PYTHONPATH, less its first entry (the
    script's directory or the working directory). See [Note: a fresh interpreter's sys.path]."""
    if not _INTERPRETER_PATH:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                             capture_output=True, text=True, env=env, check=True, timeout=120)
        _INTERPRETER_PATH.extend(json.loads(out.stdout))
    return list(_INTERPRETER_PATH)


def fresh_sys_path(first: str, pythonpath: str, base: list[str]) -> list[str]:
    """The sys.path of ``python`` started with ``first`` as its first entry and ``pythonpath`` set, where
    ``base`` is :func:`interpreter_path`."""
    return [first, *(p for p in pythonpath.split(os.pathsep) if p), *base]


def _run_script(script: str, argv: list[str], env: dict, log_path: str, cwd: str | None,
                base_path: list[str]) -> None:
    """In the forked process: become ``python <script> <argv...>`` with ``env`` in ``cwd``, logging
    to ``log_path``; ``base_path``: :func:`interpreter_path`, asked in the parent."""
    import gc
    import runpy
    gc.freeze()  # see [Note: the inherited heap out of the collector's sight]
    if cwd is not None:
        os.chdir(cwd)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered: workers leave with os._exit
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    _as_if_imported_here()
    sys.path[:] = fresh_sys_path(str(Path(script).parent), env["PYTHONPATH"], base_path)  # See [Note: a fresh interpreter's sys.path]
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


class _WarmRank:
    """A forked rank with the part of ``subprocess.Popen``'s interface ``_run`` uses."""

    def __init__(self, script: str, argv: list[str], env: dict, log_path: Path, cwd: Path | None = None):
        self.proc = _forkserver().Process(target=_run_script, args=(script, argv, env, str(log_path),
                                                                    None if cwd is None else str(cwd),
                                                                    interpreter_path()))
        self.proc.start()

    def wait(self, timeout: float) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("rank", timeout)
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)


def _start_rank(worker: str, rank: int, world_size: int, port: int, out: Path, extra_env: dict | None = None):
    """Start one rank of ``tests/workers/<worker>`` logging to ``<out>/rank<r>.log``.

    Returns ``(process, log file or None)``; the process has ``wait``/``poll``/``kill``/``returncode``.
    """
    env = _procs.child_env(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **(extra_env or {}))
    script, log_path = str(HERE / "workers" / worker), out / f"rank{rank}.log"
    if _WARM:
        return _WarmRank(script, [str(out)], env, log_path), None
    log = open(log_path, "w")
    return _ColdRank(_procs.start([sys.executable, script, str(out)], env, cwd=os.getcwd(), stdout=log)), log


class _ColdRank:
    """A fresh interpreter (``ZS_TEST_COLD_START=1``): ``kill`` takes its whole process group."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def poll(self) -> int | None:
        return self.proc.poll()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def kill(self) -> None:
        _procs.kill_group(self.proc)
        self.proc.wait(5)


def run_script(script: Path, cwd: Path, env: dict, timeout: float, argv: list[str] = ()) -> tuple[int, str]:
    """``python <script> <argv...>`` in ``cwd`` with ``env``, one process, warm like the ranks ([Note:
    warm worker start]; a fresh interpreter under ``ZS_TEST_COLD_START=1``): its exit code and output.
    A run past ``timeout`` is killed and fails with its output's tail."""
    if not _WARM:
        proc = _procs.run([sys.executable, str(script), *argv], timeout, env=env, cwd=cwd, merge_stderr=True)
        return proc.returncode, proc.stdout
    log_path = Path(cwd) / f".{Path(script).stem}.log"
    started = time.monotonic()
    proc = _WarmRank(str(script), list(argv), env, log_path, cwd)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _procs.note_launch_time(Path(script).name, timeout, time.monotonic() - started, killed=True)
        raise AssertionError(f"{script} did not finish in {timeout}s:\n{log_path.read_text()[-4000:]}") from None
    _procs.note_launch_time(Path(script).name, timeout, time.monotonic() - started)
    return code, log_path.read_text()


def run_code(code: str, cwd: Path, env: dict, timeout: float, argv: list[str] = ()) -> tuple[int, str, str]:
    """``python -c CODE ARGV...`` as :func:`run_script` runs a script (warm; a fresh interpreter under
    ``ZS_TEST_COLD_START=1``), for a test whose subject is what the code does in a process of its own,
    not the interpreter's start: its exit code, its standard output alone, and its whole log (stdout
    and stderr in order) for a failure's message. ``cwd`` (the test's ``tmp_path``) gets the script."""
    if not _WARM:
        proc = _procs.run([sys.executable, "-c", code, *argv], timeout, env=env, cwd=cwd)
        return proc.returncode, proc.stdout, proc.stdout + proc.stderr
    script, stdout = Path(cwd) / "_run_code.py", Path(cwd) / "_run_code.stdout"
    script.write_text(f"import sys\nsys.stdout = open({str(stdout)!r}, 'w', buffering=1)\n" + code)
    returncode, log = run_script(script, cwd, env, timeout, argv)
    return returncode, (stdout.read_text() if stdout.exists() else ""), log


def _run(worker: str, world_size: int, args: dict, timeout: float, out: Path) -> list[dict]:
    (out / "args.json").write_text(json.dumps(args))
    port = free_port()
    started = time.monotonic()
    procs = [_start_rank(worker, rank, world_size, port, out) for rank in range(world_size)]
    _wait_ranks(procs, started, timeout, f"{worker} on {world_size} ranks", out)
    return _procs.read_reports(out, world_size, worker)


def run_warm_ranks(script: Path, argv: list[str], rank_envs: list[dict], out: Path, timeout: float,
                   what: str, cwd: Path | None = None) -> str:
    """``python SCRIPT ARGV...`` once per environment of ``rank_envs``, every rank forked warm ([Note:
    warm worker start]) and logging to ``<out>/rank<r>.log``; their logs joined in rank order. The
    launch a test would otherwise start through a launcher whose only work is these environments
    (tests/_accelerate_launch.py)."""
    started = time.monotonic()
    procs = [(_WarmRank(str(script), argv, env, out / f"rank{r}.log", cwd), None) for r, env in enumerate(rank_envs)]
    _wait_ranks(procs, started, timeout, what, out)
    return "\n".join((out / f"rank{r}.log").read_text() for r in range(len(rank_envs)))


def _wait_ranks(procs: list, started: float, timeout: float, what: str, out: Path) -> None:
    """Wait for every rank of a launch that started at ``started``; past ``timeout`` kill them all and
    fail with each rank's log tail."""
    world_size = len(procs)
    deadline = started + timeout
    for p, log in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            _procs.note_launch_time(what, timeout, time.monotonic() - started, killed=True)
            logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(world_size))
            raise AssertionError(f"{what} did not finish in {timeout}s:\n{logs}")
        finally:
            if log is not None:
                log.close()
    _procs.note_launch_time(what, timeout, time.monotonic() - started)


def launch_faulty(worker: str, world_size: int, args: dict, survivors: list[int], out: Path,
                  timeout: float = 120.0, env: dict | None = None) -> dict:
    """Run a worker in which some rank misbehaves; wait only for the ``survivors`` to exit.

    Returns ``{"reports": {rank: report or None}, "exited": {rank: time.time() of exit or None},
    "codes": {rank: exit code}, "logs": {rank: log tail}}``; ranks still running when the
    survivors are done (a stuck rank) or at ``timeout`` are killed, so nothing is left behind.
    """
    (out / "args.json").write_text(json.dumps(args))
    port = free_port()
    procs = {rank: _start_rank(worker, rank, world_size, port, out, env) for rank in range(world_size)}
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
                p.wait(timeout=30)
            if log is not None:
                log.close()
    reports = {r: (json.loads((out / f"rank{r}.json").read_text()) if (out / f"rank{r}.json").exists() else None)
               for r in procs}
    logs = {r: (out / f"rank{r}.log").read_text()[-4000:] for r in procs}
    return dict(reports=reports, exited=exited, codes={r: p.returncode for r, (p, _) in procs.items()}, logs=logs)
