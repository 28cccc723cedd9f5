"""ZeRO-Infinity's cost curve: step time and per-rank memory of NVMe offload as the model grows,
and the NVMe step against the disk's floor (issue 44).

A thin driver over ``memory_lifecycle.py``: for each Llama size (smallest first) it runs the
systems' load and train phases only (``--phases load,train``; ``--steps`` steps, the first
``--warmup`` of them a warm-up) in fresh processes, 2 gloo ranks, bf16, one system at a time
in the same invocation, and collects per system:

* **step time**: the median over the timed steps of the slower rank's wall time
  (forward, backward and the optimizer step, each timed apart);
* **memory**: each rank's peak anonymous RSS above its baseline in the load and train
  phases (memory_lifecycle's 5 ms sampler: where tensors live, page cache and mapped files
  left out), and the baseline itself (imports and the process group);
* for ``zero3_offload_nvme`` (``--floor``): each timed step's swap bytes read and written,
  the time at least one swap request was in flight (disk busy), the time the training
  thread spent inside the store's waits, and, after the train phase, the **floor**: the
  same bytes moved with raw ``O_DIRECT`` requests of the store's size on as many threads,
  both ranks at once (``memory_lifecycle.disk_floor``): read alone + write alone.

Before each system it checks room: the disk must keep ``--min-free-gb`` free after the
model directory, the swap files (16 bytes per parameter over the ranks, DeepSpeed's as
ours) and the floor's file; host memory must hold the ranks' predicted peak (extrapolated
from the smaller sizes already measured, a straight line through the last two) with
``--memory-margin-gb`` to spare (``--no-memory-guard`` turns the memory check off, for a system
whose straight line overshoots a figure measured elsewhere; recorded in the system's ``run``). A
system that would not fit is skipped and the reason recorded; so is one that fails (with the
tail of what it printed). Each size's work directory
is deleted after it.

Results accumulate in ``--out`` (default ``benchmarks/infinity_curve.json``) size by size,
so the sizes can be run in separate invocations; ``--report`` only prints the table and the
memory fit from it and draws the plot (``--plot``, default ``benchmarks/infinity_curve.png``).

Usage (from the repository root)::

    python benchmarks/infinity_curve.py --sizes 30m                 # validate the driver
    python benchmarks/infinity_curve.py --sizes 125m,350m,750m,1.3b
    python benchmarks/infinity_curve.py --report
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 1e9

#: Llama shapes (layers, hidden, intermediate, heads) with a 32,000-token vocabulary and untied
#: embeddings, the parameter counts memory_lifecycle.ensure_model gives them
SIZES = {
    "30m": (2, 512, 1376, 8),       # 39M: the driver's own check
    "125m": (12, 768, 2048, 12),    # 134M
    "350m": (24, 1024, 2816, 16),   # 374M
    "750m": (12, 2048, 5632, 16),   # 748M: memory_lifecycle's default model
    "1.3b": (24, 2048, 5504, 16),   # 1.35B
}
SYSTEMS = "zero3_offload_nvme,zero3_offload,ds3_nvme"
SWAP_BYTES_PER_PARAM = 16  # over all ranks: fp32 master + 2 Adam moments + bf16 parameters
FLOOR_FILE_BYTES = 4 << 30  # per rank, memory_lifecycle.disk_floor's cap


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="125m,350m,750m,1.3b", help=f"from {', '.join(SIZES)}")
    p.add_argument("--systems", default=SYSTEMS)
    p.add_argument("--steps", type=int, default=3, help="train steps per system, warm-up included")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ds-sub-group-size", dest="ds_sub_group_size", type=float, default=1e8,
                   help="DeepSpeed's sub_group_size: 1e8 runs at 748M, the default 1e9 reached ~11 GiB per rank at load")
    p.add_argument("--workdir", default=None, help="parent of the per-size work directories (default: the temp dir)")
    p.add_argument("--min-free-gb", type=float, default=10.0)
    p.add_argument("--memory-margin-gb", type=float, default=3.0)
    p.add_argument("--memory-guard", action=argparse.BooleanOptionalAction, default=True,
                   help="skip a system whose predicted memory does not fit (--no-memory-guard: where a figure "
                        "measured elsewhere says it fits and the straight-line prediction overshoots; recorded)")
    p.add_argument("--timeout", type=float, default=2400, help="seconds per system")
    p.add_argument("--out", default=os.path.join(HERE, "infinity_curve.json"))
    p.add_argument("--plot", default=os.path.join(HERE, "infinity_curve.png"))
    p.add_argument("--report", action="store_true", help="only print the table and fit from --out and draw the plot")
    return p.parse_args(argv)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def llama_params(shape: tuple) -> int:
    layers, hidden, inter, _ = shape
    return layers * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) + 2 * 32000 * hidden + hidden


def summarize(system: str, raw: dict, warmup: int) -> dict:
    """The figures of one system at one size from memory_lifecycle's per-rank reports."""
    ranks = raw["ranks"]
    out = {"load_average": raw["load_average"], "errors": [r["error"] for r in ranks if r.get("error")]}
    if out["errors"]:
        out["printed_tail"] = next((r.get("printed_tail") for r in ranks if r.get("printed_tail")), None)
    for phase in ("load", "train"):
        vals = [r["phases"].get(phase, {}).get("peak_anon") for r in ranks]
        out[f"{phase}_peak_anon"] = None if None in vals else vals
    out["baseline_anon"] = [r.get("baseline_anon") for r in ranks]
    steps = [r.get("steps") or [] for r in ranks]
    if all(len(s) > warmup for s in steps):
        timed = list(zip(*(s[warmup:] for s in steps)))  # per step, one record per rank
        slower = lambda key: [max(rec.get(key, 0.0) for rec in step) for step in timed]  # noqa: E731
        out["step_s"] = statistics.median(slower("wall_s"))
        out["step_s_all"] = slower("wall_s")
        for part in ("forward_s", "backward_s", "optimizer_s"):
            out[part] = statistics.median(slower(part))
        out["step_load_average"] = [max(rec["load_average"] for rec in step) for step in timed]
        if "read_bytes" in timed[0][0]:
            for key in ("read_bytes", "written_bytes", "disk_busy_s", "disk_read_busy_s", "disk_write_busy_s",
                        "waiting_s"):
                out[key] = statistics.median(slower(key))
    floors = [r.get("floor") for r in ranks]
    if all(floors):
        # both ranks moved their bytes at once: the slower rank's time is the disk's time for the step
        out["floor"] = {k: max(f[k]["s"] for f in floors) for k in ("read", "write", "mixed")}
        out["floor"]["floor_s"] = max(f["floor_s"] for f in floors)
        out["floor"]["read_gbps"] = sum(f["read_bytes"] for f in floors) / out["floor"]["read"] / GB
        out["floor"]["write_gbps"] = sum(f["written_bytes"] for f in floors) / out["floor"]["write"] / GB
        out["floor"]["load_average"] = max(f["read"]["load_average"] for f in floors)
        out["floor"]["per_rank"] = floors
    return out


def run_size(args, label: str, rep: dict) -> None:
    shape = SIZES[label]
    n = llama_params(shape)
    base = args.workdir or tempfile.gettempdir()
    workdir = os.path.join(base, f"zs-infinity-curve-{label}")
    entry = rep["sizes"].setdefault(label, {"shape": dict(zip(("layers", "hidden", "intermediate", "heads"), shape)),
                                             "parameters": n, "systems": {}})
    try:
        for system in args.systems.split(","):
            run = {"date": datetime.date.today().isoformat(),
                   "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M"),
                   "steps": args.steps, "warmup": args.warmup, "ds_sub_group_size": args.ds_sub_group_size,
                   "memory_guard": args.memory_guard}
            reason = no_room(args, system, n, rep, base)
            if reason:
                print(f"[infinity_curve] {label} {system}: skipped: {reason}", flush=True)
                entry["systems"][system] = {"skipped": reason, "load_average": os.getloadavg()[0], "run": run}
                continue
            out = os.path.join(workdir, f"{system}.json")
            layers, hidden, inter, heads = shape
            cmd = [sys.executable, os.path.join(HERE, "memory_lifecycle.py"), "--systems", system,
                   "--layers", str(layers), "--hidden", str(hidden), "--intermediate", str(inter),
                   "--heads", str(heads), "--phases", "load,train", "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--floor", "--ds-sub-group-size", str(args.ds_sub_group_size),
                   "--workdir", workdir, "--out", out, "--timeout", str(args.timeout)]
            print(f"[infinity_curve] {label} ({n / 1e6:.0f}M) {system}: load average {os.getloadavg()[0]:.1f}, "
                  f"{mem_available() / GB:.1f} GB available, {shutil.disk_usage(base).free / GB:.1f} GB free",
                  flush=True)
            t0 = time.monotonic()
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.returncode or not os.path.exists(out):
                entry["systems"][system] = {"errors": [f"driver exit {proc.returncode}"],
                                            "printed_tail": proc.stdout[-3000:], "run": run}
                continue
            raw = json.load(open(out))
            entry["parameters"] = raw["parameters"]
            entry["systems"][system] = summarize(system, raw["systems"][system], args.warmup)
            entry["systems"][system]["wall_s"] = time.monotonic() - t0
            entry["systems"][system]["run"] = run
            entry["systems"][system]["ranks"] = raw["systems"][system]["ranks"]
            print(format_row(label, entry["parameters"], system, entry["systems"][system]), flush=True)
            save(args, rep)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the model directory and whatever a killed run left
    save(args, rep)


def no_room(args, system: str, n: int, rep: dict, base: str) -> str | None:
    """Why ``system`` at ``n`` parameters would not fit this machine now, or None."""
    need_disk = 2 * n + SWAP_BYTES_PER_PARAM * n * ("nvme" in system) + 2 * FLOOR_FILE_BYTES * (system == "zero3_offload_nvme")
    free = shutil.disk_usage(base).free
    if free - need_disk < args.min_free_gb * GB:
        return f"disk: needs ~{need_disk / GB:.1f} GB, {free / GB:.1f} GB free, {args.min_free_gb:.0f} GB must stay free"
    seen = sorted((e["parameters"], max(s["train_peak_anon"]) + max(s["baseline_anon"]))
                  for e in rep["sizes"].values() for name, s in e["systems"].items()
                  if name == system and s.get("train_peak_anon") and s.get("baseline_anon") and e["parameters"] < n)
    if not seen or not args.memory_guard:
        return None
    if len(seen) == 1:
        predicted = seen[-1][1] * n / seen[-1][0]  # proportional: an upper bound when part of it is constant
    else:
        (x0, y0), (x1, y1) = seen[-2:]
        predicted = y1 + (y1 - y0) / (x1 - x0) * (n - x1)
    avail = mem_available()
    need = 2 * predicted + args.memory_margin_gb * GB
    if need > avail:
        return (f"memory: predicted {predicted / GB:.1f} GB per rank (extrapolated from {len(seen)} smaller size(s)), "
                f"2 ranks + {args.memory_margin_gb:.0f} GB margin = {need / GB:.1f} GB > {avail / GB:.1f} GB available")
    return None


def save(args, rep: dict) -> None:
    """Written with ``sizes`` as a list of entries, each with its ``label`` (the shape the docs
    site's benchmark tables render, one table per size); held as a dict by label here."""
    on_disk = dict(rep, sizes=[dict(label=k, **v) for k, v in rep["sizes"].items()])
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(on_disk, f, indent=1)
    os.replace(tmp, args.out)


def load(path: str) -> dict:
    if not os.path.exists(path):
        return {"sizes": {}}
    rep = json.load(open(path))
    if isinstance(rep.get("sizes"), list):
        rep["sizes"] = {e.pop("label"): e for e in rep["sizes"]}
    return rep


def format_row(label: str, n: int, system: str, s: dict) -> str:
    if s.get("skipped"):
        return f"{label:>5} {n / 1e6:6.0f}M {system:20} skipped: {s['skipped']}"
    if s.get("errors"):
        return f"{label:>5} {n / 1e6:6.0f}M {system:20} failed: {s['errors'][0]}"
    gbs = lambda v: "/".join(f"{x / GB:.2f}" for x in v) if v else "-"  # noqa: E731
    row = (f"{label:>5} {n / 1e6:6.0f}M {system:20} step {s.get('step_s', float('nan')):7.2f} s "
           f"(fwd {s.get('forward_s', 0):.2f} bwd {s.get('backward_s', 0):.2f} opt {s.get('optimizer_s', 0):.2f})  "
           f"RSS load {gbs(s['load_peak_anon'])} train {gbs(s['train_peak_anon'])} GB  "
           f"load avg {max(s.get('step_load_average', [s['load_average']])):.1f}")
    if "floor" in s:
        f = s["floor"]
        row += (f"\n{'':33}swap R {s['read_bytes'] / GB:.2f} W {s['written_bytes'] / GB:.2f} GB per rank, "
                f"disk busy {s['disk_busy_s']:.2f} s, waiting {s['waiting_s']:.2f} s; floor {f['floor_s']:.2f} s "
                f"(read {f['read_gbps']:.2f} GB/s, write {f['write_gbps']:.2f} GB/s over both ranks, "
                f"load {f['load_average']:.1f}): floor / step = {f['floor_s'] / s['step_s']:.2f}")
    return row


def memory_fit(rep: dict, system: str, phase: str = "train") -> dict | None:
    """Least squares: peak anonymous RSS above baseline (slower rank) = a + b x parameters per rank."""
    pts = sorted((e["parameters"] / 2, max(s[f"{phase}_peak_anon"]))
                 for e in rep["sizes"].values() for name, s in e["systems"].items()
                 if name == system and s.get(f"{phase}_peak_anon"))
    if len(pts) < 2:
        return None
    xs, ys = zip(*pts)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    return {"points": len(pts), "constant_gb": a / GB, "bytes_per_param_per_rank": b,
            "residuals_gb": [(y - a - b * x) / GB for x, y in pts], "params_per_rank": list(xs)}


def report(args, rep: dict) -> None:
    labels = sorted(rep["sizes"], key=lambda k: rep["sizes"][k]["parameters"])
    for label in labels:
        e = rep["sizes"][label]
        for system, s in e["systems"].items():
            print(format_row(label, e["parameters"], system, s))
    systems = sorted({n for e in rep["sizes"].values() for n in e["systems"]})
    rep["fits"] = {}
    for system in systems:
        for phase in ("load", "train"):
            fit = memory_fit(rep, system, phase)
            if fit:
                rep["fits"][f"{system}/{phase}"] = fit
                print(f"fit {system:20} {phase:5}: peak RSS above baseline = {fit['constant_gb']:.2f} GB + "
                      f"{fit['bytes_per_param_per_rank']:.2f} bytes x parameters per rank ({fit['points']} sizes; "
                      f"residuals {', '.join(f'{r:+.2f}' for r in fit['residuals_gb'])} GB)")
    save(args, rep)
    if args.plot:
        plot(rep, labels, systems, args.plot)


def plot(rep: dict, labels: list, systems: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system in systems:
        pts = [(rep["sizes"][k]["parameters"] / 1e6, rep["sizes"][k]["systems"].get(system, {})) for k in labels]
        t = [(x, s["step_s"]) for x, s in pts if s.get("step_s")]
        m = [(x, max(s["train_peak_anon"]) / GB) for x, s in pts if s.get("train_peak_anon")]
        if t:
            line, = ax_t.plot(*zip(*t), marker="o", label=system)
            for (x, y), (_, s) in zip(t, [p for p in pts if p[1].get("step_s")]):
                # times move with the shared machine's load: each point says how busy it was
                ax_t.annotate(f"load {max(s['step_load_average']):.0f}", (x, y), textcoords="offset points",
                              xytext=(4, 4), fontsize=7, color=line.get_color())
        if m:
            ax_m.plot(*zip(*m), marker="o", label=system)
    for x, s in [(rep["sizes"][k]["parameters"] / 1e6, rep["sizes"][k]["systems"].get("zero3_offload_nvme", {}))
                 for k in labels]:
        if s.get("floor"):
            ax_t.plot([x], [s["floor"]["floor_s"]], marker="x", color="black", linestyle="none")
    ax_t.plot([], [], marker="x", color="black", linestyle="none", label="disk floor (zero3_offload_nvme's bytes)")
    ax_t.set(xlabel="parameters (M)", ylabel="step time (s), slower rank", title="step time, 2 gloo ranks, bf16")
    ax_m.set(xlabel="parameters (M)", ylabel="GB", title="per-rank peak anonymous RSS in training, above baseline")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ZeRO-Infinity cost curve (CPU, shared 2-core machine; {rep.get('date', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    rep = load(args.out)
    if not args.report:
        import torch
        rep.update(date=datetime.date.today().isoformat(), torch=torch.__version__,
                   config={k: v for k, v in vars(args).items() if k not in ("report", "workdir", "out", "plot")})
        for label in args.sizes.split(","):
            if label not in SIZES:
                raise SystemExit(f"unknown size {label!r}: choose from {', '.join(SIZES)}")
        for label in args.sizes.split(","):
            run_size(args, label, rep)
    report(args, rep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
