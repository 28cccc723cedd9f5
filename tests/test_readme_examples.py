"""Every Python block of README.md runs, on CPU, offline; every link in it leads somewhere.

A block runs as a script of its own (a fresh ``python`` process, so Accelerate's
per-process state and Lightning's globals never leak between blocks) in an empty
directory holding the two files the README's examples name: ``ds_config.json`` (the
README's first ``json`` block, the DeepSpeed config of "Migrating from DeepSpeed") and
``zero.yaml`` (the ``yaml`` block that starts with ``# zero.yaml``). It passes when it
exits with status 0.

A block that cannot run here says so on a line of its own,
``# readme-test: compile-only (<reason>)``: the code being replaced in a migration
(DeepSpeed), or a block that needs GPUs, several nodes, a tokenizer or files a run
writes. Such a block must still compile, name its reason, and every ``zero_strategy``
name it imports or uses (``zs.x``, ``zero_strategy.x``, ``from zero_strategy... import x``)
must exist.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import _procs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
README = ROOT / "README.md"
COMPILE_ONLY = re.compile(r"^\s*# readme-test: compile-only \((?P<reason>[^)]+)\)")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\s*$")


@dataclass
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    code: str

    @property
    def compile_only_reason(self) -> str | None:
        found = [m.group("reason").strip() for m in map(COMPILE_ONLY.match, self.code.splitlines()) if m]
        return found[0] if found else None


def blocks(text: str) -> list[Block]:
    """Fenced blocks, also indented ones inside list items (the indent is removed)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start, body = m.group("indent"), i, []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        out.append(Block(m.group("lang"), start + 1, "\n".join(body) + "\n"))
        i += 1
    return out


ALL = blocks(README.read_text(encoding="utf-8"))
PYTHON = [b for b in ALL if b.lang == "python"]
RUNNABLE = [b for b in PYTHON if b.compile_only_reason is None]
COMPILE = [b for b in PYTHON if b.compile_only_reason is not None]


def fixture_files() -> dict[str, str]:
    ds = next(b for b in ALL if b.lang == "json")
    zero = next(b for b in ALL if b.lang == "yaml" and b.code.startswith("# zero.yaml"))
    json.loads(ds.code)  # the README's ds_config is valid JSON
    return {"ds_config.json": ds.code, "zero.yaml": zero.code}


def _env() -> dict:
    return _procs.child_env(drop=_procs.LAUNCH_VARS + ("ZERO_STRATEGY_CONFIG", "ACCELERATE_USE_DEEPSPEED",
                                                       "ACCELERATE_USE_CPU", "ZERO_STRATEGY_ADOPTED_DEEPSPEED_LAUNCH"),
                            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def test_the_readme_has_python_examples_that_run():
    """Most examples run for real; compile-only is the exception, not the rule."""
    assert len(RUNNABLE) >= 10 and len(RUNNABLE) > len(COMPILE)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", RUNNABLE, ids=[f"line{b.line}" for b in RUNNABLE])
def test_python_block_runs(block: Block):
    work = Path(tempfile.mkdtemp(prefix="zs_readme_"))
    try:
        for name, content in fixture_files().items():
            (work / name).write_text(content)
        (work / "example.py").write_text(block.code)
        proc = _procs.run([sys.executable, "example.py"], 280, env=_env(), cwd=work)
        assert proc.returncode == 0, (f"README.md block at line {block.line} failed:\n"
                                      f"{(proc.stdout + proc.stderr)[-5000:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _zero_strategy_names(tree: ast.AST) -> list[tuple[str, str]]:
    """(module, attribute) pairs the code takes from zero_strategy."""
    aliases = {"zero_strategy": "zero_strategy"}
    found: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "zero_strategy":
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "zero_strategy":
            found.extend((node.module, a.name) for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.append((aliases[node.value.id], node.attr))
    return found


@pytest.mark.parametrize("block", COMPILE, ids=[f"line{b.line}" for b in COMPILE])
def test_compile_only_block_compiles_and_names_exist(block: Block):
    assert len(block.compile_only_reason) > 10, "say why the block cannot run here"
    tree = ast.parse(compile(block.code, f"README.md:{block.line}", "exec", ast.PyCF_ONLY_AST))
    for module, name in _zero_strategy_names(tree):
        assert hasattr(importlib.import_module(module), name), f"README.md:{block.line}: {module}.{name} does not exist"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_link_leads_somewhere():
    text = README.read_text(encoding="utf-8")
    outside_code = re.sub(r"```.*?```", "", text, flags=re.S)
    anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", outside_code, flags=re.M)}
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", outside_code):
        if target.startswith(("http://", "https://")):
            continue
        if target.startswith("#"):
            if target[1:] not in anchors:
                missing.append(target)
        elif not (ROOT / target.split("#")[0]).exists():
            missing.append(target)
    assert missing == []


def test_every_file_the_prose_names_exists():
    """Paths written in backticks or plainly (``tests/...py``, ``recipes/...``, ``benchmarks/...``) exist."""
    text = README.read_text(encoding="utf-8")
    names = set(re.findall(r"\b((?:tests|recipes|benchmarks|src)/[\w./-]+\.(?:py|md|yaml|sh))\b", text))
    names |= set(re.findall(r"(?<![/\w])([A-Z]+\.md)\b", text))  # SECURITY.md, CHANGELOG.md at the root
    missing = sorted(n for n in names if not (ROOT / n).exists() and not (ROOT / "tests" / n).exists())
    assert missing == []
