"""Every test file that starts a Python interpreter says so with the ``multiprocess`` marker, so
``python -m pytest -m "not multiprocess"`` starts none (docs/testing.md, "Tiers").

Two checks: this file's, static, over the files (a file that can start processes, through
``subprocess``, ``multiprocessing``, tests/_procs.py or a helper module importing one of
them at its top, carries the marker); and tests/conftest.py's, at run time, over the tests
(a test not marked that starts an interpreter, in its body or in a fixture it sets up, fails).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
STARTERS = {"subprocess", "multiprocessing", "_procs"}
# files that import subprocess for processes that are not interpreters
NOT_INTERPRETERS = {"test_checkpoint_save_failures.py": "mount/umount of a small tmpfs"}


def _top_imports(path: Path) -> set[str]:
    """The modules ``path`` imports at module level (a function's own import is its own business)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, (ast.If, ast.Try)):
            names |= {n for sub in ast.walk(node) if isinstance(sub, ast.Import) for n in
                      (a.name.split(".")[0] for a in sub.names)}
    return names


def _all_imports(path: Path) -> set[str]:
    """The modules ``path`` imports anywhere, a test function's own imports too."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


HELPERS = {p.stem: p for p in HERE.glob("_*.py")}


def _starts(module: str, seen: frozenset = frozenset()) -> bool:
    """Whether importing ``module`` (a helper's module-level imports, transitively) brings a starter."""
    if module in STARTERS:
        return True
    if module not in HELPERS or module in seen:
        return False
    return any(_starts(m, seen | {module}) for m in _top_imports(HELPERS[module]))


def _can_start(path: Path) -> bool:
    return any(_starts(m) for m in _all_imports(path))


def _marked(path: Path) -> bool:
    return "pytest.mark.multiprocess" in path.read_text()


TEST_FILES = sorted(HERE.glob("test_*.py"))


def test_the_scan_sees_the_launchers():
    assert _starts("_launch") and _starts("_accelerate_launch") and _starts("_recipe_helpers")
    assert not _starts("_models")
    assert _can_start(HERE / "test_parity_ddp.py") and not _can_start(HERE / "test_flat_layout.py")


@pytest.mark.parametrize("path", TEST_FILES, ids=[p.name for p in TEST_FILES])
def test_a_file_that_starts_interpreters_is_marked_multiprocess(path):
    if path.name in NOT_INTERPRETERS or not _can_start(path):
        return
    assert _marked(path), (
        f"{path.name} can start processes (it imports {sorted(m for m in _all_imports(path) if _starts(m))}) "
        "but marks nothing multiprocess: mark the tests that start them (conftest fails a test that "
        "starts an interpreter unmarked)")


def test_the_run_time_check_flags_an_interpreter_started_unmarked():
    import subprocess
    import sys

    import conftest

    assert conftest._is_interpreter([sys.executable, "-c", "pass"])
    assert not conftest._is_interpreter(["mount", "-t", "tmpfs"])
    try:
        with conftest._refuse_processes("this test"):
            with pytest.raises(OSError):  # an interpreter that is not there: nothing really starts
                subprocess.Popen([sys.executable + "-not-there", "-c", "pass"])
        assert any(line.startswith("this test started") for line in conftest._STARTED), conftest._STARTED
    finally:
        conftest._STARTED.clear()
