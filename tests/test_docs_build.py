"""The documentation site builds with ``mkdocs build --strict``: warnings are errors.

mkdocs.yml turns on every link validation mkdocs has (missing pages, missing anchors,
absolute and unrecognized links), and mkdocstrings warns about a docstring naming a
parameter the signature lacks, so a broken link, a renamed heading or a stale API name
fails here. The site goes to a temporary directory; nothing is written in the checkout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import _procs

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
pytest.importorskip("material")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_site_builds_strict(tmp_path):
    proc = _procs.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                      230, env=_procs.child_env(NO_MKDOCS_2_WARNING="1"), cwd=ROOT)
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(warnings or [proc.stderr[-3000:]])
    assert (tmp_path / "site" / "architecture" / "index.html").exists()
    assert (tmp_path / "site" / "api" / "config" / "index.html").exists()


def test_the_results_page_renders_benchmark_json(tmp_path, monkeypatch):
    """The hook turns a benchmark JSON into a table with the load average beside each row."""
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import benchmark_tables
    finally:
        sys.path.pop(0)
    out = tmp_path / "benchmarks" / "out"
    out.mkdir(parents=True)
    (out / "generation_bench.json").write_text(json.dumps({
        "cpus": 2, "loadavg_at_end": [2.5, 2.0, 1.5],
        "rows": [{"system": "stock", "median_s": 0.5, "loadavg_1min": 1.8},
                 {"system": "once", "median_s": 0.6, "loadavg_1min": 2.1},
                 {"system": "x|y", "median_s": None, "message": "gave up on '<root>'"}]}))
    (out / "cpu_adam_bench.json").write_text(json.dumps({
        "loadavg_at_end": [0.3, 0.4, 0.5], "sizes": [{"params": 1000, "systems": {"fused": {"step_s": 0.01}}}]}))
    text = benchmark_tables.render(tmp_path)
    assert "| system | median_s | message | load average |" in text
    assert "| once | 0.6 |  | 2.1 |" in text
    assert "| x\\|y | – | gave up on '&lt;root&gt;' | not recorded |" in text  # cells escaped, missing load left empty
    assert "| fused | 0.01 | 0.3 / 0.4 / 0.5 at end |" in text
    assert "No benchmark output" in benchmark_tables.render(tmp_path / "empty")
