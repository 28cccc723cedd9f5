"""pyproject.toml declares every package the code needs, where the code needs it.

A plain ``pip install zero-strategy`` must save checkpoints and run NVMe offload;
``pip install zero-strategy[<front end>]`` must make ``import zero_strategy.<front end>``
work. The code is read with ``ast`` (tests/_dependency_scan.py says exactly what
counts: lazy imports do, ``tensor.numpy()`` does, imports guarded by
``except ImportError`` are optional), import names are mapped to distributions
through the installed metadata (``yaml`` -> PyYAML), and each need is looked up in

* the base dependencies, for core modules (everything outside a front end);
* the base dependencies plus the front end's extra, for ``zero_strategy.lightning``,
  ``zero_strategy.accelerate`` and ``zero_strategy.transformers``.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from _dependency_scan import Use, needed, requirement_name, scan_package, scan_source, undeclared

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the suite's interpreter

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "zero_strategy"
FRONT_ENDS = {"lightning": "lightning", "accelerate": "accelerate", "transformers": "transformers"}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def mapping() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "fakepkg"


FAKE_PROJECT = {"dependencies": ["torch>=2.4,<3", "PyYAML>=6"],
                "optional-dependencies": {"lightning": ["lightning"], "accelerate": ["accelerate"],
                                          "transformers": ["transformers"], "test": ["surely-only-for-tests"]}}


# ------------------------------------------------------------------ the real package
def test_every_needed_package_is_declared_where_it_is_needed():
    problems = undeclared(scan_package(ROOT / "src" / PACKAGE), project(), PACKAGE, FRONT_ENDS, mapping())
    assert not problems, "pyproject.toml misses:\n" + "\n".join(problems)


def test_each_front_end_has_its_extra():
    extras = project()["optional-dependencies"]
    for subpackage, extra in FRONT_ENDS.items():
        assert (ROOT / "src" / PACKAGE / subpackage / "__init__.py").exists()
        assert requirement_name(extras[extra][0]) == extra, f"the {extra!r} extra must install {extra} first"


def test_the_scan_sees_the_packages_we_know_the_code_uses():
    """A guard on the scanner itself: a scan that found nothing would pass the test above."""
    need = needed(scan_package(ROOT / "src" / PACKAGE), PACKAGE, FRONT_ENDS)
    tops = lambda module: {u.top for u in need[module]}  # noqa: E731
    assert {"torch", "yaml", "safetensors", "numpy"} <= set().union(*(tops(m) for m in need if ".lightning" not in m
                                                                      and ".accelerate" not in m
                                                                      and ".transformers" not in m))
    assert "numpy" in tops(f"{PACKAGE}._mechanisms.swap_file")  # buf.numpy() for the swap file's I/O
    assert "lightning" in tops(f"{PACKAGE}.lightning._strategy")
    assert "accelerate" in tops(f"{PACKAGE}.transformers")  # through zero_strategy.accelerate
    assert "lightning" not in tops(PACKAGE), "import zero_strategy must not need Lightning"


def test_installed_versions_satisfy_the_declared_bounds():
    """The suite runs against these versions, so the bounds must admit them (torch 2.13 in >=2.4,<3)."""
    packaging = pytest.importorskip("packaging.requirements")
    reqs = list(project()["dependencies"])
    for extra in FRONT_ENDS.values():
        reqs += project()["optional-dependencies"][extra]
    for spec in reqs:
        req = packaging.Requirement(spec)
        try:
            installed = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert req.specifier.contains(installed, prereleases=True), f"{spec} excludes installed {installed}"
    assert "torch>=2.4,<3" in project()["dependencies"]


# ------------------------------------------------------------------ the checker can fail
def test_an_undeclared_import_in_a_core_module_is_reported(tmp_path):
    pkg = write_package(tmp_path, {
        "fakepkg/__init__.py": "from . import core\n",
        "fakepkg/core.py": "import torch\nimport yaml\n\ndef later():\n    import surely_not_declared_pkg\n",
    })
    problems = undeclared(scan_package(pkg), FAKE_PROJECT, "fakepkg", FRONT_ENDS, mapping())
    assert any("fakepkg.core needs ['surely-not-declared-pkg']" in p and "core:5" in p for p in problems), problems
    assert not any("yaml" in p.lower() or "torch" in p for p in problems), "PyYAML is declared as PyYAML"


def test_an_extra_only_package_in_core_is_reported_but_fine_in_its_front_end(tmp_path):
    pkg = write_package(tmp_path, {
        "fakepkg/__init__.py": "",
        "fakepkg/core.py": "import lightning\n",
        "fakepkg/lightning/__init__.py": "import lightning.pytorch\n",
    })
    problems = undeclared(scan_package(pkg), FAKE_PROJECT, "fakepkg", FRONT_ENDS, mapping())
    assert [p.split(" needs")[0] for p in problems] == ["fakepkg.core"], problems


def test_a_front_end_importing_another_needs_that_ones_packages(tmp_path):
    """zero_strategy.transformers builds on zero_strategy.accelerate: its extra must install accelerate."""
    pkg = write_package(tmp_path, {
        "fakepkg/__init__.py": "",
        "fakepkg/accelerate/__init__.py": "from ._acc import A\n",
        "fakepkg/accelerate/_acc.py": "import accelerate\nA = 1\n",
        "fakepkg/transformers/__init__.py": "import transformers\nfrom ..accelerate import A\n",
    })
    problems = undeclared(scan_package(pkg), FAKE_PROJECT, "fakepkg", FRONT_ENDS, mapping())
    assert problems and all("fakepkg.transformers needs ['accelerate']" in p for p in problems), problems


def test_tensor_numpy_counts_as_needing_numpy(tmp_path):
    pkg = write_package(tmp_path, {"fakepkg/__init__.py": "def view(t):\n    return memoryview(t.numpy())\n"})
    problems = undeclared(scan_package(pkg), FAKE_PROJECT, "fakepkg", FRONT_ENDS, mapping())
    assert len(problems) == 1 and "['numpy']" in problems[0] and "uses numpy" in problems[0], problems


def test_optional_imports_need_only_be_installable_through_some_extra(tmp_path):
    pkg = write_package(tmp_path, {"fakepkg/__init__.py": (
        "try:\n    import transformers\nexcept ImportError:\n    transformers = None\n"
        "try:\n    import surely_not_declared_pkg\nexcept (ModuleNotFoundError, OSError):\n    pass\n")})
    problems = undeclared(scan_package(pkg), FAKE_PROJECT, "fakepkg", FRONT_ENDS, mapping())
    assert len(problems) == 1 and "surely-not-declared-pkg" in problems[0] and "optional" in problems[0], problems


def test_a_core_lazy_alias_of_a_front_end_is_that_front_ends_entry_point(tmp_path):
    """``zero_strategy.ZeroAccelerator`` (a module __getattr__) needs the accelerate extra, not the base."""
    pkg = write_package(tmp_path, {
        "fakepkg/__init__.py": "def __getattr__(name):\n    from .accelerate import A\n    return A\n",
        "fakepkg/accelerate/__init__.py": "import accelerate\nA = 1\n",
    })
    assert undeclared(scan_package(pkg), FAKE_PROJECT, "fakepkg", FRONT_ENDS, mapping()) == []


def test_scan_records_how_each_import_is_used():
    source = ("from typing import TYPE_CHECKING\nimport torch\nif TYPE_CHECKING:\n    import numpy\n"
              "def f():\n    from .sub import x\n    import importlib\n    importlib.import_module('yaml')\n")
    uses = scan_source(source, "pkg.mod")
    assert Use("pkg.mod", "torch", 2) in uses
    assert Use("pkg.mod", "pkg.sub.x", 6, lazy=True) in uses
    assert Use("pkg.mod", "yaml", 8, lazy=True) in uses
    assert not any(u.top == "numpy" for u in uses), "TYPE_CHECKING imports never run"
