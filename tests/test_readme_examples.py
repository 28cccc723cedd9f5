"""Every Python block of README.md runs, on CPU, offline; every link in it leads somewhere.

The rules for blocks are in tests/_markdown_blocks.py (shared with test_docs_examples.py,
which applies them to docs/): a block runs as a script of its own in a directory holding
``ds_config.json`` and ``zero.yaml``, or, marked ``# readme-test: compile-only (<reason>)``,
compiles and names only ``zero_strategy`` names that exist.

README links go to files of the repository, mostly pages of docs/; a link with an anchor
(``docs/guides/launching.md#slurm``) must name a heading of that page, slugged as the site
builds it (Python-Markdown's toc), or an explicit ``<a id=...>``.
"""

from __future__ import annotations

import re

import pytest
from markdown.extensions.toc import slugify

from _markdown_blocks import ROOT, Block, blocks, check_compile_only, missing_named_files, run_block

README = ROOT / "README.md"
ALL = blocks(README)
PYTHON = [b for b in ALL if b.lang == "python"]
RUNNABLE = [b for b in PYTHON if b.compile_only_reason is None]
COMPILE = [b for b in PYTHON if b.compile_only_reason is not None]


def test_the_readme_has_python_examples_that_run():
    """One runnable example per front end (plain PyTorch, Lightning, Accelerate, HF Trainer); compile-only is the
    exception, not the rule."""
    assert len(RUNNABLE) >= 4 and len(RUNNABLE) > len(COMPILE)


@pytest.mark.multiprocess
@pytest.mark.slow  # the default tier compiles every block and checks its names
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", RUNNABLE, ids=[f"line{b.line}" for b in RUNNABLE])
def test_python_block_runs(block: Block):
    run_block(block)


@pytest.mark.parametrize("block", COMPILE, ids=[f"line{b.line}" for b in COMPILE])
def test_compile_only_block_compiles_and_names_exist(block: Block):
    check_compile_only(block)


def _outside_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _page_anchors(page) -> set[str]:
    text = _outside_code(page.read_text(encoding="utf-8"))
    headings = [re.sub(r"`", "", h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)]
    return {slugify(h, "-") for h in headings} | set(re.findall(r'<a id="([^"]+)"', text))


def test_every_link_leads_somewhere():
    text = _outside_code(README.read_text(encoding="utf-8"))
    anchors = {_github_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors:
                missing.append(target)
        elif not (ROOT / path).exists():
            missing.append(target)
        elif anchor and path.endswith(".md") and anchor not in _page_anchors(ROOT / path):
            missing.append(target)
    assert missing == []


def test_every_file_the_prose_names_exists():
    assert missing_named_files(README.read_text(encoding="utf-8")) == []
