"""The rules for code blocks in Markdown (README.md and docs/**/*.md), shared by the tests that apply them.

A Python block runs as a script of its own (a fresh ``python`` process, so Accelerate's
per-process state and Lightning's globals never leak between blocks) in an empty
directory holding the two files the examples name: ``ds_config.json`` (the first ``json``
block of docs/guides/migrating-from-deepspeed.md, the DeepSpeed config of "Migrating from
DeepSpeed") and ``zero.yaml`` (the ``yaml`` block of docs/configuration.md that starts with
``# zero.yaml``). It passes when it exits with status 0.

A block that cannot run here says so on a line of its own,
``# readme-test: compile-only (<reason>)``: the code being replaced in a migration
(DeepSpeed), or a block that needs GPUs, several nodes, a tokenizer or files a run
writes. Such a block must still compile, name its reason, and every ``zero_strategy``
name it imports or uses (``zs.x``, ``zero_strategy.x``, ``from zero_strategy... import x``)
must exist.

Used by test_readme_examples.py (README.md) and test_docs_examples.py (docs/).
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import _procs
from _launch import run_script

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
COMPILE_ONLY = re.compile(r"^\s*# readme-test: compile-only \((?P<reason>[^)]+)\)")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)\s*$")
FILE_NAMES = re.compile(r"\b((?:tests|recipes|benchmarks|src)/[\w./-]+\.(?:py|md|yaml|sh))\b")
ROOT_FILE_NAMES = re.compile(r"(?<![/\w])([A-Z]+\.md)\b")  # SECURITY.md, CHANGELOG.md at the root


@dataclass
class Block:
    source: str  # the file, relative to the repository root
    lang: str
    line: int  # 1-based line of the opening fence
    code: str

    @property
    def compile_only_reason(self) -> str | None:
        found = [m.group("reason").strip() for m in map(COMPILE_ONLY.match, self.code.splitlines()) if m]
        return found[0] if found else None

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """Fenced blocks, also indented ones inside list items (the indent is removed)."""
    source = path.relative_to(ROOT).as_posix()
    out, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
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
        out.append(Block(source, m.group("lang"), start + 1, "\n".join(body) + "\n"))
        i += 1
    return out


def fixture_files() -> dict[str, str]:
    ds = next(b for b in blocks(DOCS / "guides" / "migrating-from-deepspeed.md") if b.lang == "json")
    zero = next(b for b in blocks(DOCS / "configuration.md") if b.lang == "yaml" and b.code.startswith("# zero.yaml"))
    json.loads(ds.code)  # the documented ds_config is valid JSON
    return {"ds_config.json": ds.code, "zero.yaml": zero.code}


def _env() -> dict:
    return _procs.child_env(drop=_procs.LAUNCH_VARS + _procs.FRONT_END_VARS,
                            HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def run_block(block: Block) -> None:
    work = Path(tempfile.mkdtemp(prefix="zs_md_"))
    try:
        for name, content in fixture_files().items():
            (work / name).write_text(content)
        (work / "example.py").write_text(block.code)
        code, output = run_script(work / "example.py", work, _env(), 280)
        assert code == 0, f"{block.id} failed (exit code {code}):\n{output[-5000:]}"
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


def check_compile_only(block: Block) -> None:
    assert len(block.compile_only_reason) > 10, "say why the block cannot run here"
    tree = ast.parse(compile(block.code, block.id, "exec", ast.PyCF_ONLY_AST))
    for module, name in _zero_strategy_names(tree):
        assert hasattr(importlib.import_module(module), name), f"{block.id}: {module}.{name} does not exist"


def missing_named_files(text: str) -> list[str]:
    """Paths written in backticks or plainly (``tests/...py``, ``recipes/...``, ``benchmarks/...``) that do not exist."""
    names = set(FILE_NAMES.findall(text)) | set(ROOT_FILE_NAMES.findall(text))
    return sorted(n for n in names if not (ROOT / n).exists() and not (ROOT / "tests" / n).exists())
