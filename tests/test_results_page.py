"""The results page shows where the project stands, from one JSON, and says where each figure came from.

``benchmarks/current.json`` holds the current figures, one table per concern; RESULTS.md opens with
them (written by ``benchmarks/results_page.py``) and the docs site's results page renders the same
JSON (``docs/hooks/benchmark_tables.py``). The oracles here are independent of that renderer:
RESULTS.md's tables are parsed back cell by cell and compared with the JSON's fields; each figure is
looked up in the history section or benchmark JSON its row names as its source (so none is invented
or rounded otherwise); the memory and fault rows are recomputed from their benchmark JSON.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "RESULTS.md"
CURRENT = json.loads((BENCH / "current.json").read_text(encoding="utf-8"))
ROWS = [(c["id"], r) for c in CURRENT["concerns"] for r in c["rows"]]
FIELDS = ("figure", "value", "unit", "compared_with", "date", "command", "load_average", "source")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def _results_page():
    spec = importlib.util.spec_from_file_location("results_page_under_test", BENCH / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row_id(item) -> str:
    concern, row = item
    return f"{concern}:{row['figure'][:40]}"


def _has(text: str, number: str) -> bool:
    """``number`` written in ``text`` as a whole number: 1.23 is not found in 1.233 nor 11.23."""
    return re.search(r"(?<!\d)(?<!\d\.)" + re.escape(number) + r"(?!\d)(?!\.\d)", text) is not None


def _history_sections() -> dict[str, str]:
    """RESULTS.md's dated sections after "## History", by heading (without "## "), with their text."""
    history = RESULTS.read_text(encoding="utf-8").split("\n## History\n", 1)[1]
    sections, title = {}, None
    for line in history.splitlines():
        if line.startswith("## "):
            title = line[3:]
            sections[title] = ""
        elif title is not None:
            sections[title] += line + "\n"
    return sections


def _source_text(row: dict) -> str:
    """The text of every source a row names: a history section (named by its heading's start) or a JSON."""
    sections, text = _history_sections(), ""
    for part in row["source"].split("; "):
        if part.startswith("RESULTS.md: "):
            start = part[len("RESULTS.md: "):]
            found = [t for t in sections if t.startswith(start)]
            assert len(found) == 1, f"{row['figure']!r}: {len(found)} history sections start with {start!r}"
            text += found[0] + "\n" + sections[found[0]]
        else:
            assert re.fullmatch(r"benchmarks/[\w.]+\.json", part), f"{row['figure']!r}: unknown source {part!r}"
            assert (ROOT / part).is_file(), f"{row['figure']!r}: {part} does not exist"
    return text


def test_the_concerns_the_page_promises_each_have_a_table():
    ids = [c["id"] for c in CURRENT["concerns"]]
    assert ids[:4] == ["speed", "memory", "nvme", "cpu_step"]
    assert all(c["rows"] and c["title"] and c["intro"] for c in CURRENT["concerns"])
    # speed beside each baseline the issue names, and a row that says what has not run (no GPU)
    speed = " ".join(r["compared_with"] for r in CURRENT["concerns"][0]["rows"])
    assert all(name in speed for name in ("torch DDP", "DeepSpeed", "FSDP2"))
    for concern in CURRENT["concerns"][:4]:
        assert any(r["value"] == "not measured" and "GPU" in r["figure"] for r in concern["rows"]), concern["id"]


@pytest.mark.parametrize("item", ROWS, ids=_row_id)
def test_every_row_has_a_date_a_command_and_a_load(item):
    _, row = item
    assert set(FIELDS) <= set(row), f"missing: {set(FIELDS) - set(row)}"
    assert all(isinstance(row[k], str) and not {"|", "\n"} & set(row[k]) for k in FIELDS + ("note",) if k in row)
    assert re.fullmatch(r"(python|bash) benchmarks/\S+\.(py|sh)( .*)?", row["command"]), row["command"]
    if row["value"] == "not measured":
        assert row["date"] == "not run" and row["load_average"] == "not run"
    else:
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", row["date"]), row["date"]
        assert NUMBER.search(row["load_average"]), row["load_average"]
        assert row["unit"]


@pytest.mark.parametrize("item", ROWS, ids=_row_id)
def test_every_figure_is_found_in_its_source(item):
    """A number in a value or a comparison that its source does not contain was typed, not copied."""
    _, row = item
    text = _source_text(row)
    for key in ("value", "compared_with", "load_average"):
        for number in NUMBER.findall(row[key]):
            assert _has(text, number), f"{row['figure']!r}: {key} {number} is not in {row['source']!r}"
    if row["value"] != "not measured":
        assert row["date"] in text, f"{row['figure']!r}: the date is not its source's"
        assert row["command"] in text or row["command"].split(" ", 1)[1] in text.replace("`", ""), row["command"]
    notes = RESULTS.read_text(encoding="utf-8")  # a note may cite an older section: anywhere in the history
    for number in NUMBER.findall(row.get("note", "")):
        assert _has(notes, number), f"{row['figure']!r}: note {number} is nowhere in RESULTS.md"


def _w(peak: int, w: int) -> str:
    return f"{peak / w:.2f}"


def _lifecycle_cell(report: dict, system: str, phase: str) -> str:
    """A cell of memory_lifecycle.py's own table: rank 0 / rank 1 peak in W, or the export's."""
    res, w = report["systems"][system], report["W_bytes"]
    if phase == "export":
        return "fails" if res["export"].get("error") else _w(res["export"]["peak_anon"], w)
    return "/".join(_w(r["phases"][phase]["peak_anon"], w) for r in res["ranks"])


@pytest.mark.parametrize("item", [i for i in ROWS if "check" in i[1]], ids=_row_id)
def test_rows_from_a_benchmark_json_equal_it(item):
    _, row = item
    check = row["check"]
    report = json.loads((ROOT / check["json"]).read_text(encoding="utf-8"))
    assert check["json"] in row["source"]
    if "phase" in check:
        assert row["value"] == _lifecycle_cell(report, check["system"], check["phase"])
        assert f"{report['systems'][check['system']]['load_average']:.1f}" in row["load_average"]
        if "beside" in check:
            assert _lifecycle_cell(report, check["beside"], check["phase"]) in row["compared_with"]
            assert f"{report['systems'][check['beside']]['load_average']:.1f}" in row["load_average"]
    else:
        seconds = {r["engine"]: r["seconds"] for r in report["rows"] if r["case"] == check["case"]}
        assert row["value"] == " / ".join(str(seconds[e]) for e in check["engines"])
        assert seconds["ddp"] is None and "still waiting" in row["compared_with"]


def _tables(text: str) -> dict[str, list[list[str]]]:
    """Markdown tables under each ### heading of ``text``: rows of cells, the header row first."""
    tables, title = {}, None
    for line in text.splitlines():
        if line.startswith("#"):  # a table belongs to the ### heading above it, no other
            title = line[4:] if line.startswith("### ") else None
            if title is not None:
                tables[title] = []
        elif title is not None and line.startswith("| "):
            tables[title].append([c.strip() for c in line.strip()[2:-2].split(" | ")])
    return tables


def _expected_cells(row: dict) -> list[str]:
    value = f"{row['value']} {row['unit']}".strip()
    return [row["figure"], value if row["value"] == "not measured" else f"**{value}**", row["compared_with"],
            row["date"], row["load_average"], f"`{row['command']}`", row["source"], row.get("note", "")]


def test_results_md_opens_with_the_json_tables():
    text = RESULTS.read_text(encoding="utf-8")
    page = _results_page()
    head, _, history = text.partition("\n## History\n")
    assert history, "RESULTS.md lost its history heading"
    stand = head.index("\n## Where we stand\n")
    assert head.index(page.BEGIN) > stand and page.END in head, "the tables sit under 'Where we stand', before History"
    tables = _tables(page.current_block(head))
    assert list(tables) == [c["title"] for c in CURRENT["concerns"]]
    for concern in CURRENT["concerns"]:
        header, *rows = tables[concern["title"]]
        assert header == ["figure", "value", "compared with", "date", "load average", "command", "source", "note"]
        assert rows == [_expected_cells(r) for r in concern["rows"]], concern["title"]
        assert f"### {concern['title']}\n\n{concern['intro']}\n" in head
    assert page.block(CURRENT) in text, "run python benchmarks/results_page.py"


def test_the_history_keeps_its_dated_sections():
    sections = _history_sections()
    assert len(sections) >= 22
    assert "Every figure below was printed by the command above it, in one run, with all" in \
        RESULTS.read_text(encoding="utf-8").split("\n## History\n", 1)[1]
    assert next(iter(sections)).startswith("CPU, 2 gloo ranks — 2026-11-30")


def test_the_site_renders_the_same_json():
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import benchmark_tables
    finally:
        sys.path.pop(0)
    source = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    site = benchmark_tables.on_page_markdown(source, SimpleNamespace(file=SimpleNamespace(src_uri="results.md")),
                                             None, None)
    tables = _tables(site)
    for concern in CURRENT["concerns"]:
        assert tables[concern["title"]][1:] == [_expected_cells(r) for r in concern["rows"]], concern["title"]
    assert _results_page().render(CURRENT) in site
    assert "benchmarks/current.json" not in [p.relative_to(ROOT).as_posix() for p in benchmark_tables.sources()]
