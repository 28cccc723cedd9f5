"""The "Where we stand" tables: benchmarks/current.json rendered as Markdown, one table per concern.

``current.json`` holds the newest recorded figure of each thing, copied from a section of
RESULTS.md's dated history or from a benchmark JSON (each row names its source), with its date,
command and load average. Two pages show it and must not disagree:

* ``benchmarks/RESULTS.md`` opens with these tables, between the marker lines below; this script
  rewrites them there (``--check`` only says whether they are current);
* the docs site's results page (``docs/results.md``), where ``docs/hooks/benchmark_tables.py``
  renders the same JSON at build time with :func:`render`.

tests/test_results_page.py checks that RESULTS.md's tables are what the JSON says, that every
row has a date, a command and a load average, and that each figure is found in its source.

Usage (from the repository root)::

    python benchmarks/results_page.py            # rewrite the tables at the top of RESULTS.md
    python benchmarks/results_page.py --check    # exit 1 if they differ from current.json

Standard library only: the docs build imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CURRENT = HERE / "current.json"
RESULTS = HERE / "RESULTS.md"
BEGIN = "<!-- where-we-stand: generated from benchmarks/current.json by benchmarks/results_page.py -->"
END = "<!-- /where-we-stand -->"
COLUMNS = (("figure", "figure"), ("value", "value"), ("compared with", "compared_with"), ("date", "date"),
           ("load average", "load_average"), ("command", "command"), ("source", "source"), ("note", "note"))
NOT_MEASURED = "not measured"


def load(path: Path = CURRENT) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def cell(row: dict, key: str) -> str:
    """One table cell of a row, as RESULTS.md and the site show it."""
    if key == "value":
        text = f"{row['value']} {row.get('unit', '')}".strip()
        return text if row["value"] == NOT_MEASURED else f"**{text}**"
    if key == "command":
        return f"`{row['command']}`"
    return str(row.get(key, "")).strip()


def render(data: dict, level: int = 3) -> str:
    """The tables, one per concern, each under a heading of ``level``."""
    out = []
    for concern in data["concerns"]:
        out += ["#" * level + " " + concern["title"], "", concern["intro"], ""]
        out.append("| " + " | ".join(name for name, _ in COLUMNS) + " |")
        out.append("|" + "---|" * len(COLUMNS))
        for row in concern["rows"]:
            out.append("| " + " | ".join(cell(row, key) for _, key in COLUMNS) + " |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def block(data: dict) -> str:
    """What stands between the markers in RESULTS.md, the markers included."""
    return (f"{BEGIN}\n\n*Generated from [current.json](current.json) by `python benchmarks/results_page.py`:"
            f" edit the JSON, not these tables.*\n\n{render(data)}\n{END}")


def current_block(text: str) -> str:
    """The marked block of RESULTS.md's text, the markers included."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[start:end]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md's tables differ from current.json")
    args = parser.parse_args(argv)
    text = RESULTS.read_text(encoding="utf-8")
    new = text.replace(current_block(text), block(load()))
    if args.check:
        if new != text:
            print("benchmarks/RESULTS.md's tables differ from benchmarks/current.json: "
                  "run python benchmarks/results_page.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        RESULTS.write_text(new, encoding="utf-8")
        print("rewrote the tables at the top of benchmarks/RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
