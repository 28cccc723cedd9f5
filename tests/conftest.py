"""Test-session setup: the worktree's src first on sys.path, one thread per process, and one
private temporary directory for everything the session and its subprocesses create
(``TMPDIR``), removed at the end, so a suite leaves nothing in /tmp."""

import contextlib
import functools
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _session_tmpdir():
    root = tempfile.mkdtemp(prefix="zs_session_")
    saved_env, saved_tempdir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = root, root
    yield
    tempfile.tempdir = saved_tempdir
    if saved_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved_env
    shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ tiers (docs/testing.md, "Tiers")
# ``python -m pytest -m "not multiprocess"``: seconds, no interpreter started (checked below).
# ``python -m pytest``: the default tier, the ``slow`` tests deselected (not skipped).
# ``python -m pytest --full`` (or ZS_TEST_FULL=1; what .ci/run runs): everything.
def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run the full suite: also the tests marked slow (default: deselected)")


def _full(config) -> bool:
    if config.getoption("--full") or os.environ.get("ZS_TEST_FULL") == "1":
        return True
    if "slow" in (config.getoption("markexpr") or ""):
        return True  # -m names slow itself: the expression decides
    return any("::" in str(arg) for arg in config.args)  # tests named one by one run as named


def pytest_collection_modifyitems(config, items):
    if not _full(config):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
            config.hook.pytest_deselected(items=slow)
            config._zs_slow_deselected = len(slow)
    if hasattr(config, "workerinput"):  # an xdist worker: see [Note: a shared launch runs on one worker]
        items.sort(key=lambda item: item.get_closest_marker("multiprocess") is None)  # stable


# ------------------------------------------------------------------ workers (-n N): one launch per shared launch
# [Note: a shared launch runs on one worker]
# Many test modules start their ranks once for all their cases (a ``functools.lru_cache`` launch, or
# a module-scoped fixture) and each test asserts its own case. xdist's default scheduling ("load")
# deals tests to the workers round-robin, so each of the three workers that took one of a module's
# tests ran that module's launch again: the DeepSpeed checkpoint runs, the setup-cost counts, the
# DCP and compile matrices, each up to three times. So under ``-n`` (unless the command line names
# ``--dist``) the scheduling is xdist's "loadscope" with one scope per test, except that the tests
# of a module that shares a launch are one scope, and so are those of all the modules that import
# one helper that caches launches (tests/_accounting.py): they run on one worker, which launches once.
# (xdist's own ``loadgroup`` would do it from markers, but under pytest 9.2 its renaming of the
# test ids no longer takes effect.) The shared modules go out first, those with the most tests
# first (xdist's order of scopes), then the single tests, with those that start interpreters ahead
# of those that do not (each worker sorts its collection so), so the in-process tests, a fraction of
# a second each, fill the end and the workers finish together.
_SHARED_LAUNCH = re.compile(r"^\s*@(functools\.)?(lru_)?cache\b|scope=[\"'](module|package|session)[\"']", re.MULTILINE)
_HELPER_IMPORT = re.compile(r"^(?:from (_\w+) import|import (_\w+))", re.MULTILINE)


@functools.lru_cache(maxsize=None)
def shared_launch_scope(path: Path) -> str | None:
    """The scope of a test module's tests under ``-n``: the module's own path where it caches something
    across its tests (an ``lru_cache`` function, or a fixture whose scope is wider than one test), the
    path of a tests/_*.py helper that caches launches for several modules (tests/_accounting.py), or
    None: one scope per test. Read from the source: xdist's controller imports no test."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for helper in sorted({a or b for a, b in _HELPER_IMPORT.findall(text)}):
        helper_path = path.parent / f"{helper}.py"
        if helper_path.is_file() and _SHARED_LAUNCH.search(helper_path.read_text()):
            return str(helper_path)
    return str(path) if _SHARED_LAUNCH.search(text) else None


def _explicit_dist(config) -> bool:
    return any(str(a) == "--dist" or str(a).startswith(("--dist=", "-d")) for a in config.invocation_params.args)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist", "no") != "load" or _explicit_dist(config):
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class SharedLaunchScheduling(LoadScopeScheduling):
        """One scope per test, one per module (or helper's modules) that shares a launch."""

        def _split_scope(self, nodeid: str) -> str:
            return shared_launch_scope(config.rootpath / nodeid.split("::", 1)[0]) or nodeid

    return SharedLaunchScheduling(config, log)


# ------------------------------------------------------------------ the multiprocess marker, enforced
# A test that starts a Python interpreter (subprocess, multiprocessing, tests/_procs.py and the
# launchers on it) must be marked ``multiprocess``, so ``-m "not multiprocess"`` really starts
# none. Module-scoped fixtures run in the setup of the first test that asks for them: that
# test must be marked too. tests/test_markers.py checks the files statically as well.
_STARTED: list[str] = []


def _is_interpreter(args) -> bool:
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    return any(os.path.basename(str(a)).startswith("python") or str(a) == sys.executable for a in argv)


@contextlib.contextmanager
def _refuse_processes(nodeid: str):
    import multiprocessing.process
    import subprocess

    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def guarded_popen(self, args, *a, **k):
        if _is_interpreter(args):
            _STARTED.append(f"{nodeid} started {args!r}")
        return popen_init(self, args, *a, **k)

    def guarded_start(self):
        _STARTED.append(f"{nodeid} started a multiprocessing process")
        return process_start(self)

    subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = guarded_popen, guarded_start
    try:
        yield
    finally:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = popen_init, process_start


def _guarded(item):
    if item.get_closest_marker("multiprocess") is not None:
        return contextlib.nullcontext()
    return _refuse_processes(item.nodeid)


def _fail_if_started(outcome):
    if _STARTED:
        what = _STARTED[0]
        _STARTED.clear()
        outcome.force_exception(pytest.fail.Exception(
            f"{what} without @pytest.mark.multiprocess: mark the test (or its module), so "
            "`-m \"not multiprocess\"` starts no interpreter"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):
        outcome = yield
    _fail_if_started(outcome)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        outcome = yield
    _fail_if_started(outcome)


# ------------------------------------------------------------------ time limits, sized from the record
# Every launch notes its elapsed time beside its limit (tests/_procs.py ``note_launch_time``), and
# every test item its setup+call+teardown beside pytest-timeout's limit, in one record for the
# session (all xdist workers append to the file the controller names). The summary lists what came
# nearest its limit, so a limit is sized from what a loaded machine took (docs/testing.md, "Time
# limits"), not guessed, and a launch drifting towards its limit is seen before it is killed.
NEAR_LIMIT = 0.5  # a share of the limit worth listing in the summary


# [Note: the checkout compiled once, not in every rank]
# Where Python may not write bytecode (PYTHONDONTWRITEBYTECODE, as on this project's development
# machine), every interpreter the suite starts, each forked rank included, compiled every module of
# this checkout it imported from its source again: about 0.2 s of CPU per rank for zero_strategy
# alone, and a suite starts several hundred ranks. The session compiles src/, tests/ and recipes/
# once at its start (about 4 s): compileall writes the caches whatever that variable says, and
# Python reads them either way; a source edited since is compiled again, in memory, as always.
def _compile_checkout() -> None:
    import compileall
    for part in ("src", "tests", "recipes"):
        compileall.compile_dir(str(HERE.parent / part), quiet=1)


def pytest_configure(config):
    import _procs
    if not hasattr(config, "workerinput"):
        _compile_checkout()
    if hasattr(config, "workerinput") or os.environ.get(_procs.LAUNCH_TIMES):
        return  # an xdist worker (the controller named the record), or a record the caller keeps
    fd, path = tempfile.mkstemp(prefix="zs_launch_times_", suffix=".jsonl")
    os.close(fd)
    os.environ[_procs.LAUNCH_TIMES] = config._zs_own_launch_times = path


def pytest_unconfigure(config):
    path = getattr(config, "_zs_own_launch_times", None)
    if path:
        os.environ.pop("ZS_TEST_LAUNCH_TIMES", None)
        with contextlib.suppress(OSError):
            os.unlink(path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import time

    import _procs
    started = time.monotonic()
    yield
    elapsed = time.monotonic() - started
    marker = item.get_closest_marker("timeout")
    limit = marker.args[0] if marker is not None and marker.args else item.config.getini("timeout")
    if elapsed > 5 and limit:
        _procs.note_launch_time("pytest-timeout (setup+call+teardown)", float(limit), elapsed, test=item.nodeid)


def near_limits(lines: list[str], share: float = NEAR_LIMIT, at_least: int = 10) -> list[dict]:
    """The recorded limits nearest to being hit: every one past ``share`` of its limit, and at least
    the ``at_least`` nearest, nearest first."""
    import json
    rows = [json.loads(line) for line in lines if line.strip()]
    rows.sort(key=lambda r: r["elapsed"] / r["limit"], reverse=True)
    return [r for i, r in enumerate(rows) if i < at_least or r["elapsed"] / r["limit"] >= share]


def pytest_terminal_summary(terminalreporter, config):
    n = getattr(config, "_zs_slow_deselected", 0)
    if n:
        terminalreporter.write_line(f"{n} slow tests deselected (the default tier): --full runs them too")
    path = os.environ.get("ZS_TEST_LAUNCH_TIMES")
    if hasattr(config, "workerinput") or not path or not os.path.exists(path):
        return
    with open(path) as f:
        rows = near_limits(f.readlines())
    if not rows:
        return
    terminalreporter.section("time limits: the launches and tests nearest theirs")
    for r in rows:
        flag = " KILLED" if r["killed"] else ""
        terminalreporter.write_line(f"{r['elapsed']:7.1f} s of {r['limit']:5.0f} s ({r['elapsed'] / r['limit']:4.0%}, "
                                    f"load {r['load']:.1f}){flag}  {r['what']}  [{r['test']}]")
