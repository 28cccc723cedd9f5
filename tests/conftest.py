"""Test-session setup: the worktree's src first on sys.path, one thread per process, and one
private temporary directory for everything the session and its subprocesses create
(``TMPDIR``), removed at the end, so a suite leaves nothing in /tmp."""

import os
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
