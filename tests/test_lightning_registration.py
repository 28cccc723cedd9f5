"""Registration without ``import zero_strategy``, and the standalone ``pytorch_lightning`` package.

Lightning has no discovery mechanism for strategies (its one entry-point group is for
callbacks, read after the strategy flag is resolved), so the opt-in is a ``.pth`` file.
These tests process it the way ``site.py`` does at interpreter start (``python -E -S`` then
``site.addsitedir``, so no other .pth of this environment interferes) and check that it
registers the presets when the package is there, and does nothing, silently, once the
package is uninstalled or moved.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from zero_strategy.lightning.__main__ import PTH, install, pth_text, uninstall  # noqa: E402

import _procs  # noqa: E402
from _launch import run_code  # noqa: E402

SRC = Path(__file__).resolve().parent.parent / "src"
PURELIB = sysconfig.get_paths()["purelib"]  # torch and Lightning; the editable install's finder is not run by -S

REGISTERED = ("from lightning.pytorch.strategies import StrategyRegistry as T; "
              "from lightning.fabric.strategies import STRATEGY_REGISTRY as F; "
              "print('zero3_offload' in T, 'zero3_offload' in F)")


def _start_python(site_dir: Path, package_root: Path | None, code: str = "pass") -> subprocess.CompletedProcess:
    """A fresh interpreter whose site dir is ``site_dir``, with ``zero_strategy`` importable from ``package_root``."""
    path = ([str(package_root)] if package_root is not None else []) + [PURELIB]
    prelude = f"import sys; sys.path[:0] = {path!r}; import site; site.addsitedir({str(site_dir)!r}); "
    return _procs.run([sys.executable, "-E", "-S", "-c", prelude + code], 180)  # -E: PYTHONPATH not read


def _copy_package(dest: Path) -> Path:
    shutil.copytree(SRC / "zero_strategy", dest / "zero_strategy", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_pth_line_stores_no_path():
    line = pth_text()
    assert line.count("\n") == 1 and line.startswith("import ")
    assert str(SRC) not in line and "_autoregister_hook.py" in line and "find_spec(\"zero_strategy\")" in line


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hook_registers_the_presets_without_importing_zero_strategy_or_torch_at_start(tmp_path):
    (tmp_path / "site").mkdir()
    install(tmp_path / "site")
    out = _start_python(tmp_path / "site", SRC, "print('torch' in sys.modules, 'zero_strategy' in sys.modules); "
                                                + REGISTERED)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "False", "True", "True"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hook_is_silent_once_the_package_is_uninstalled(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    install(site)
    out = _start_python(site, None, "import importlib.util; print(importlib.util.find_spec('zero_strategy'))")
    assert (out.returncode, out.stderr, out.stdout) == (0, "", "None\n")
    out = _start_python(site, None, REGISTERED)  # Lightning imports as it would without the hook
    assert (out.returncode, out.stderr, out.stdout) == (0, "", "False False\n")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hook_follows_a_moved_package_and_is_silent_when_it_is_gone(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    install(site)
    first = _copy_package(tmp_path / "first")
    out = _start_python(site, first, REGISTERED)
    assert (out.returncode, out.stdout) == (0, "True True\n"), out.stderr[-3000:]
    second = tmp_path / "second"
    first.rename(second)  # moved: the .pth finds it at its new place
    out = _start_python(site, second, REGISTERED + "; import zero_strategy; print(zero_strategy.__file__)")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[0] == "True True" and str(second) in out.stdout
    out = _start_python(site, first, REGISTERED)  # the old place is empty now
    assert (out.returncode, out.stderr, out.stdout) == (0, "", "False False\n")
    (second / "zero_strategy" / "lightning" / "_autoregister_hook.py").unlink()  # an install without the hook
    out = _start_python(site, second, "pass")
    assert (out.returncode, out.stderr, out.stdout) == (0, "", "")


def test_uninstall_removes_the_file(tmp_path):
    assert install(tmp_path).name == PTH and (tmp_path / PTH).is_file()
    uninstall(tmp_path)
    assert not (tmp_path / PTH).exists()


STANDALONE = """
import warnings
import zero_strategy
{imports}
try:
    {call}
except ValueError as err:
    print("REFUSED:", err)
"""


def _run_beside_pytest(code: str, tmp_path: Path) -> tuple[str, str]:
    """``code`` in a process of its own, forked warm (tests/_launch.py's ``run_code``): what these tests
    check is what zero_strategy does next to the standalone packages once they are imported, not how
    an interpreter starts, so torch and Lightning's shared dependencies come preloaded (the unified
    ``lightning`` package among them, as in an environment that has both; the standalone packages'
    registries and classes are their own). Its standard output, and its whole log for a failure's
    message."""
    _, stdout, log = run_code(code, tmp_path, _procs.child_env(), 180)
    return stdout, log


def _skip_without_pytorch_lightning() -> None:
    """Skip where the standalone package is not installed, without importing it into pytest's process:
    there it would stay in ``sys.modules``, and every later test on this worker that makes a strategy
    would get the standalone-package warning (test_lightning_deepspeed_kwargs.py makes it an error)."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        pytest.skip("pytorch_lightning is not installed")


@pytest.mark.parametrize("imports,call", [
    ("import pytorch_lightning as pl", "pl.Trainer(accelerator='cpu', devices=1, strategy='zero3')"),
    ("from lightning_fabric import Fabric", "Fabric(accelerator='cpu', devices=1, strategy='zero3_offload')"),
])
@pytest.mark.multiprocess
@pytest.mark.slow
def test_standalone_packages_refuse_the_preset_names_with_the_fix(imports, call, tmp_path):
    _skip_without_pytorch_lightning()
    out, log = _run_beside_pytest(STANDALONE.format(imports=imports, call=call), tmp_path)
    assert "REFUSED:" in out, log[-3000:]
    assert "import lightning.pytorch as pl" in out and "pip install lightning" in out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_strategy_made_next_to_pytorch_lightning_says_which_package_it_needs(tmp_path):
    _skip_without_pytorch_lightning()
    code = ("import warnings, zero_strategy, pytorch_lightning as pl\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    s = zero_strategy.ZeroStrategy(stage=2)\n"
            "print([str(x.message) for x in w])\n"
            "try:\n"
            "    pl.Trainer(accelerator='cpu', devices=1, strategy=s)\n"
            "except ValueError as err:\n"
            "    print('REJECTED')\n")
    out, log = _run_beside_pytest(code, tmp_path)
    assert "import lightning.pytorch as pl" in out and "REJECTED" in out, log[-3000:]
