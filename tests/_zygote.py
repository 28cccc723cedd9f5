"""Warm Python processes for commands that a launcher, not the test, starts: a zygote forked from
tests/_launch.py's forkserver (torch, transformers and Lightning imported once) that forks one
process per request, and a shim script (tests/_zygote_shim.py) that a launcher starts in place of
``python SCRIPT ...`` or ``python -m MODULE ...`` and that asks the zygote for the real thing.

[Note: warm processes behind a launcher]
tests/_launch.py forks the ranks it starts itself from a warm forkserver. A test of a launcher
(torchrun's static and c10d rendezvous across two simulated nodes, ``accelerate launch
--num_machines 2``, SLURM's variables) cannot: the launcher starts its ranks with ``subprocess``, each
a cold interpreter importing torch (and Lightning, and zero_strategy from its source), about
3 s of CPU per process, six processes a test. So the test starts ``python tests/_zygote_shim.py
<the same arguments>`` (:func:`warm_command`) instead, for the launcher and for the script the
launcher runs: the shim imports only the standard library, sends its arguments, environment,
working directory and standard streams (the file descriptors themselves) to the zygote, and the
zygote forks a process that becomes that command with exactly those. The shim waits for it, hands
on the signals a launcher sends its workers (SIGTERM, SIGINT, SIGHUP) and exits with its exit code,
so the launcher sees what it would have seen. What the launcher does (rendezvous, the variables
it sets per rank, the order of starts, the checks of its exit codes) is unchanged; only the
interpreter behind each process is warm. A shim that dies (a test's timeout kills the launcher's
process group) closes its connection, and the zygote kills the process it stood for with that
process's whole group. ``ZS_TEST_COLD_START=1`` keeps every command as it is.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import _launch
from _zygote_shim import recv_exact

SHIM = str(Path(__file__).resolve().parent / "_zygote_shim.py")
ADDRESS = "ZS_TEST_ZYGOTE"  # the environment variable that tells the shim where the zygote listens
_STARTED: dict[str, str] = {}


def warm_command(cmd: list[str], env: dict) -> tuple[list[str], dict]:
    """``cmd`` (``[python, SCRIPT or -m MODULE or -c CODE, ...]``) as the shim's command, and ``env`` with the
    zygote's address; both unchanged under ``ZS_TEST_COLD_START=1``. Inside ``cmd``, a script a launcher
    will run (an argument naming a tests/ worker) is left as it is: prefix it with :data:`SHIM` where
    its processes should be warm too."""
    if not _launch._WARM:
        return cmd, env
    assert cmd[0] == sys.executable, cmd
    return [sys.executable, SHIM, *cmd[1:]], {**env, ADDRESS: _address()}


def rank_entry(script: str) -> list[str]:
    """The script argument of a launcher command: ``[SHIM, script]`` where processes start warm,
    ``[script]`` under ``ZS_TEST_COLD_START=1``."""
    return [SHIM, script] if _launch._WARM else [script]


def _address() -> str:
    """The zygote's socket, started on first use in this test process."""
    if "path" not in _STARTED:
        path = os.path.join(tempfile.mkdtemp(prefix="zs_zygote_", dir=os.path.dirname(tempfile.gettempdir())),
                            "socket")
        proc = _launch._forkserver().Process(target=_serve, args=(path, _launch.interpreter_path()), daemon=True)
        proc.start()
        for _ in range(600):  # it binds within a moment of starting
            if os.path.exists(path):
                break
            proc.join(0.05)
        else:
            raise RuntimeError("the zygote did not start")
        _STARTED["path"] = path
    return _STARTED["path"]


def _serve(path: str, base_path: list[str]) -> None:
    """The zygote: accept a request, fork the process it asks for, report its pid and later its exit
    code on the same connection; kill it if the connection closes first. One thread only (it forks).
    What it inherited from the forkserver, and so what every process it forks inherits, is out of the
    garbage collector's sight: see [Note: the inherited heap out of the collector's sight] in
    tests/_launch.py. ``base_path``: :func:`_launch.interpreter_path`, asked in the parent."""
    import gc
    gc.freeze()
    # a fresh interpreter's path, which each request's process extends as its command line would
    # (See [Note: a fresh interpreter's sys.path] in tests/_launch.py)
    sys.path[:] = base_path
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    running: dict[int, socket.socket | None] = {}  # pid -> the shim's connection, None once it closed
    while True:
        ready, _, _ = select.select([server, *(c for c in running.values() if c is not None)], [], [], 0.05)
        for conn in ready:
            if conn is server:
                try:
                    _start(server, running)
                except OSError:  # a shim that died while asking: nothing was started, or it is killed
                    pass
                continue
            # a shim's connection readable: it closed (the shim died) before its process ended
            pid = next(p for p, c in running.items() if c is conn)
            try:
                closed = not conn.recv(1)
            except OSError:
                closed = True
            if closed:
                with_group_killed(pid)
                conn.close()
                running[pid] = None
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()


def with_group_killed(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def _start(server: socket.socket, running: dict) -> None:
    conn, _ = server.accept()
    head, fds, _, _ = socket.recv_fds(conn, 4, 3)
    request = json.loads(recv_exact(conn, struct.unpack("!I", head + recv_exact(conn, 4 - len(head)))[0]))
    pid = os.fork()
    if pid == 0:
        server.close()
        for other in running.values():
            other.close()
        conn.close()
        _become(request, fds)
    for fd in fds:
        os.close(fd)
    running[pid] = conn
    try:
        conn.sendall(struct.pack("!i", pid))
    except OSError:  # the shim died meanwhile
        with_group_killed(pid)
        conn.close()
        running[pid] = None


def _become(request: dict, fds: list[int]) -> None:
    """In the forked process: the command the shim was started as, with its environment, working
    directory and standard streams; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: killed with everything it starts if its shim dies
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        sys.stdin = open(0, closefd=False)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _launch._as_if_imported_here()
        atexit._clear()  # the zygote's own exit handlers are not this process's
        argv = request["argv"]
        if argv[:1] == ["-u"]:  # unbuffered: its streams are line-buffered here already
            argv = argv[1:]
        paths = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:0] = ["", *paths]  # as ``python -c``: the working directory first
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:0] = [request["cwd"], *paths]  # as ``python -m``: the working directory first
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[:0] = [str(Path(argv[0]).resolve().parent), *paths]  # as ``python SCRIPT``
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as an interpreter would, then the exit code
        traceback.print_exc()
    try:  # what an interpreter does at exit: wait for its threads, then run its exit handlers
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
