"""Render the benchmark JSON files as tables on results.md, at build time.

Two marker lines of ``results.md`` are replaced:

* ``<!-- where-we-stand -->``: the current figures, ``benchmarks/current.json``, rendered by
  ``benchmarks/results_page.py``, the same code that writes the tables at the top of
  ``benchmarks/RESULTS.md``, so the site and RESULTS.md cannot disagree;
* ``<!-- benchmark-tables -->``: the raw output of the scripts. They write JSON
  (``benchmarks/out/*.json``, ignored by git, and the committed ``benchmarks/*.json``); this
  hook reads whatever is there when the site is built and puts one section per file, so no
  figure there is copied by hand. Each JSON's layout is the script's own; the renderer knows
  only the shapes they share:

* ``rows``: a list of dicts, one table row each;
* ``systems``: a dict of dicts keyed by system name, one row per system;
* ``sizes``: a list of entries that each hold ``systems`` (``cpu_adam_bench.py``).

A row's scalar fields become columns (nested values are left out: the JSON has them). The load
average goes beside every figure: the row's own (``loadavg_1min``, ``load_average``) where the
script records one per row, else the run's (``loadavg_at_end``, ``loadavg_start``/``loadavg_end``),
else the table says it is not recorded.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- benchmark-tables -->"
CURRENT_MARKER = "<!-- where-we-stand -->"
CURRENT = "current.json"  # benchmarks/current.json: the curated figures, not a script's output
PAGE = "results.md"
ROW_LOAD_KEYS = ("loadavg_1min", "load_average", "loadavg")
MAX_COLUMNS = 12


def sources(root: Path = ROOT) -> list[Path]:
    committed = [p for p in sorted((root / "benchmarks").glob("*.json")) if p.name != CURRENT]
    return sorted((root / "benchmarks" / "out").glob("*.json")) + committed


def results_page(root: Path = ROOT):
    """``benchmarks/results_page.py``, loaded from its file (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("zs_benchmarks_results_page", root / "benchmarks" / "results_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render_current(root: Path = ROOT) -> str:
    """The "Where we stand" tables of benchmarks/current.json, as RESULTS.md shows them."""
    page = results_page(root)
    return page.render(page.load(root / "benchmarks" / CURRENT))


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
        return " / ".join(_fmt(float(x)) for x in v)
    text = str(v).replace("\n", " ")
    text = text if len(text) <= 120 else text[:117] + "..."
    # table cells: a "|" would end the cell, and "<root>" in an error message would be read as HTML
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def run_load(report: dict) -> str | None:
    """The run's load average as the JSON records it, or None."""
    for key in ("loadavg_at_end", "loadavg_end"):
        if key in report:
            start = report.get("loadavg_start")
            end = _fmt(report[key])
            return f"{_fmt(start)} at start, {end} at end" if start is not None else f"{end} at end"
    for key in ("loadavg", "load_average"):
        if key in report:
            return _fmt(report[key])
    return None


def table(rows: list[dict], run_load_text: str | None) -> list[str]:
    columns: list[str] = []
    for r in rows:
        for k, v in r.items():
            if _scalar(v) and k not in columns and k not in ROW_LOAD_KEYS:
                columns.append(k)
    columns = columns[:MAX_COLUMNS]
    row_load = next((k for k in ROW_LOAD_KEYS if any(k in r for r in rows)), None)
    head = columns + ["load average" + ("" if row_load else " (run)")]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if row_load:  # the table is of per-row loads: a row without its own has none, not the run's
            load = _fmt(r[row_load]) if row_load in r else "not recorded"
        else:
            load = run_load_text or "not recorded"
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + f" | {load} |")
    return out


def render_report(name: str, report: dict) -> list[str]:
    out = [f"## `{name}`", ""]
    load = run_load(report)
    rows_have_load = any(isinstance(r, dict) and any(k in r for k in ROW_LOAD_KEYS)
                         for r in report.get("rows", []) if isinstance(report.get("rows"), list))
    if load:
        out.append(f"Load average of the run: {load}.")
    elif rows_have_load:
        out.append("The load average beside each row is the one the script recorded with it.")
    else:
        out.append("The JSON records no load average.")
    out.append("")
    settings = {k: v for k, v in report.items() if _scalar(v) and not k.startswith("loadavg")}
    if settings:
        out.append("Settings: " + ", ".join(f"`{k}` = {_fmt(v)}" for k, v in settings.items()) + ".")
        out.append("")
    tables = []
    if isinstance(report.get("rows"), list):
        tables.append(("", [r for r in report["rows"] if isinstance(r, dict)]))
    if isinstance(report.get("systems"), dict):
        tables.append(("", [dict(system=k, **v) for k, v in report["systems"].items() if isinstance(v, dict)]))
    for size in report.get("sizes", []) if isinstance(report.get("sizes"), list) else []:
        if isinstance(size, dict) and isinstance(size.get("systems"), dict):
            label = ", ".join(f"{k} {_fmt(v)}" for k, v in size.items() if _scalar(v))
            tables.append((label, [dict(system=k, **v) for k, v in size["systems"].items() if isinstance(v, dict)]))
    if not tables:
        out.append("No table-shaped entries (`rows`, `systems`, `sizes`) in this file; read the JSON itself.")
        out.append("")
    for label, rows in tables:
        if label:
            out += [f"**{label}**", ""]
        out += table(rows, load) + [""]
    return out


def render(root: Path = ROOT) -> str:
    files = sources(root)
    if not files:
        return ("*No benchmark output was present when this site was built:* `benchmarks/out/` is empty "
                "(it is ignored by git). Run the scripts (see [benchmarks/README.md](repo/benchmarks/README.md)) "
                "and build again.\n")
    out = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            out += [f"## `{rel}`", "", f"Could not be read: {type(e).__name__}: {e}.", ""]
            continue
        if not isinstance(report, dict):
            out += [f"## `{rel}`", "", "Not a JSON object; left out.", ""]
            continue
        out += render_report(rel, report)
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != PAGE:
        return markdown
    for marker in (CURRENT_MARKER, MARKER):
        if marker not in markdown:
            raise ValueError(f"{PAGE} lost its marker line {marker!r}")
    return markdown.replace(CURRENT_MARKER, render_current()).replace(MARKER, render())
