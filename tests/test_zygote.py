"""The warm zygote behind the launchers (tests/_zygote.py, [Note: warm processes behind a launcher])
stands in for ``python ARGS`` as a launcher sees it: the exit code comes back, a signal the launcher
sends reaches the process, its output goes where the shim's went, and a shim killed outright (a
test's timeout killing the launcher's group) leaves no process behind. Compared with what a plain
interpreter does for the same commands."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import _launch
import _procs
from _zygote import warm_command

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not _launch._WARM, reason="ZS_TEST_COLD_START=1: no zygote")]

SLEEPER = "import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(120)\n"


def _both(code: str, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """``python -c code`` run plainly and through the zygote, both with ``env`` (default: the children's)."""
    env = env or _procs.child_env()
    plain = [sys.executable, "-c", code]
    warm, warm_env = warm_command(plain, env)
    return [subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=60)
            for cmd, e in ((plain, env), (warm, warm_env))]


def test_exit_codes_and_output_are_an_interpreters():
    for code in ("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
                 "raise SystemExit('a message')", "1 / 0", "print('done')"):
        plain, warm = _both(code)
        assert warm.returncode == plain.returncode, (code, plain, warm)
        assert warm.stdout == plain.stdout, code
        last = [p.stderr.strip().splitlines()[-1:] for p in (plain, warm)]  # the message, or nothing
        assert last[0] == last[1], (code, last)


def test_the_hub_settings_are_the_commands_not_the_zygotes(tmp_path):
    """huggingface_hub reads ``HF_HUB_OFFLINE`` and ``HF_HOME`` once, at import, and the zygote imported it
    with the test's environment: a command's own settings (the recipes run offline) must win, as in a
    fresh interpreter."""
    code = ("from huggingface_hub import constants, is_offline_mode; "
            "print(is_offline_mode(), constants.HF_HOME, constants.HF_HUB_CACHE)")
    for offline in ("1", "0"):
        env = _procs.child_env(HF_HUB_OFFLINE=offline, HF_HOME=str(tmp_path / f"home{offline}"))
        env.pop("HF_HUB_CACHE", None)
        plain, warm = _both(code, env)
        assert plain.returncode == 0, plain.stderr[-2000:]
        assert plain.stdout.split()[0] == ("True" if offline == "1" else "False"), plain.stdout
        assert warm.stdout == plain.stdout, (offline, plain.stdout, warm.stdout, warm.stderr[-2000:])


def _sleeping(**popen) -> tuple[subprocess.Popen, int]:
    cmd, env = warm_command([sys.executable, "-c", SLEEPER], _procs.child_env())
    shim = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, **popen)
    return shim, int(shim.stdout.readline())


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_signal_to_the_shim_reaches_the_process_and_comes_back_as_its_exit():
    shim, pid = _sleeping()
    assert pid != shim.pid  # the process is the zygote's, not the shim itself
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(30) == -signal.SIGTERM  # as a plain interpreter killed by SIGTERM
    assert _gone(pid)


def test_a_shim_killed_outright_leaves_no_process_behind():
    shim, pid = _sleeping(start_new_session=True)
    os.killpg(shim.pid, signal.SIGKILL)  # what _procs.kill_group does at a timeout
    shim.wait(30)
    assert _gone(pid), f"process {pid} outlived its shim"
