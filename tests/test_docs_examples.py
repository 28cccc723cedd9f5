"""Every Python block of the documentation pages (docs/**/*.md) runs, on CPU, offline.

The same rules as README.md's blocks (tests/_markdown_blocks.py): a block runs as a
script of its own, or, marked ``# readme-test: compile-only (<reason>)``, compiles and
names only ``zero_strategy`` names that exist. Links are checked by the strict site
build (test_docs_build.py); the files the prose names are checked here.
"""

from __future__ import annotations

import pytest

from _markdown_blocks import DOCS, ROOT, Block, blocks, check_compile_only, missing_named_files, run_block

PAGES = sorted(DOCS.rglob("*.md"))
PYTHON = [b for page in PAGES for b in blocks(page) if b.lang == "python"]
RUNNABLE = [b for b in PYTHON if b.compile_only_reason is None]
COMPILE = [b for b in PYTHON if b.compile_only_reason is not None]


def test_the_pages_have_python_examples_that_run():
    """Most examples run for real; compile-only is the exception, not the rule."""
    assert len(RUNNABLE) >= 10 and len(RUNNABLE) > len(COMPILE)


@pytest.mark.multiprocess
@pytest.mark.slow  # the default tier compiles every block and checks its names
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_python_block_runs(block: Block):
    run_block(block)


@pytest.mark.parametrize("block", COMPILE, ids=[b.id for b in COMPILE])
def test_compile_only_block_compiles_and_names_exist(block: Block):
    check_compile_only(block)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_file_the_prose_names_exists(page):
    assert missing_named_files(page.read_text(encoding="utf-8")) == []
