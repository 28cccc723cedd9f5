"""How long the surviving rank takes to leave, and what it says, when a peer fails: torch DDP vs ZeRO.

Runs tests/workers/faults.py on 2 gloo ranks: rank 1 raises, is SIGKILLed, hangs, or
issues a collective the others don't (desync) at step 3. The process group keeps torch's
default timeout (30 minutes), as in a user's script; the ZeRO runs keep
``ZeroConfig.collective_timeout`` at ``--timeout`` (default 300 s: the shipped default).
A survivor still running after ``--cap`` seconds is reported as such and killed.

    python benchmarks/fault_bench.py --engines ddp zero2 zero3 --timeout 300 --cap 400

Prints a Markdown table and writes benchmarks/fault_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from _launch import launch_faulty  # noqa: E402

CASES = ["raise", "sigkill", "stuck", "desync"]


def first_line(report: dict | None, log: str) -> str:
    if report is not None and report.get("error"):
        text = f"{report['error']}: {report['message']}"
    else:
        errors = [line for line in log.splitlines() if "Error" in line]
        text = errors[-1] if errors else "(no error)"
    names = []
    for pattern in (r"Group rank 1 reported: [^\n(]{0,60}", r"Group ranks 1 reported nothing", r"Desync: collective #\d+",
                    r"step \d+\)"):
        m = re.search(pattern, text)
        if m:
            names.append(m.group(0))
    head = re.sub(r"\s+", " ", text.splitlines()[0] if text else "")[:110]
    return head + (f" [names: {'; '.join(names)}]" if names else "")


def run(engine: str, case: str, timeout: float, cap: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix="zs_fault_bench_"))
    result = launch_faulty("faults.py", 2, {"case": case, "engine": engine, "timeout": timeout},
                           survivors=[0], out=out, timeout=cap)
    failed_at = float((out / "fail_time").read_text())
    shutil.rmtree(out, ignore_errors=True)
    exited = result["exited"][0]
    return dict(engine=engine, case=case, seconds=None if exited is None else round(exited - failed_at, 1),
                message=first_line(result["reports"][0], result["logs"][0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["ddp", "zero2", "zero3"])
    parser.add_argument("--cases", nargs="+", default=CASES)
    parser.add_argument("--timeout", type=float, default=300.0, help="ZeroConfig.collective_timeout (s)")
    parser.add_argument("--cap", type=float, default=400.0, help="stop waiting for the survivor after (s)")
    args = parser.parse_args()
    rows = [run(e, c, args.timeout, args.cap) for c in args.cases for e in args.engines]
    print(f"load average: {os.getloadavg()[0]:.1f}; collective_timeout {args.timeout:g} s; cap {args.cap:g} s\n")
    print("| case | engine | survivor exits after | its error |")
    print("|---|---|---|---|")
    for r in rows:
        took = f"{r['seconds']} s" if r["seconds"] is not None else f"still waiting at {args.cap:g} s"
        print(f"| {r['case']} | {r['engine']} | {took} | {r['message'].replace('|', '/')} |")
    (HERE / "fault_bench.json").write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
