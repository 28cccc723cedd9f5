"""Publish repository files that the documentation links to (benchmarks/RESULTS.md, SECURITY.md, ...).

They live outside ``docs/`` and are maintained there; this hook adds them to the site at build
time under ``repo/`` so that the pages can link to them and nothing is copied by hand.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
FILES = {
    "repo/benchmarks/RESULTS.md": "benchmarks/RESULTS.md",
    "repo/benchmarks/README.md": "benchmarks/README.md",
    "repo/benchmarks/current.json": "benchmarks/current.json",  # RESULTS.md links to it
    "repo/SECURITY.md": "SECURITY.md",
    "repo/CHANGELOG.md": "CHANGELOG.md",
    "repo/benchmarks/infinity_curve.png": "benchmarks/infinity_curve.png",  # RESULTS.md and results.md show it
}


def on_files(files, config):
    for uri, source in FILES.items():
        path = ROOT / source
        content = path.read_bytes() if path.suffix == ".png" else path.read_text(encoding="utf-8")
        files.append(File.generated(config, uri, content=content))
    return files
