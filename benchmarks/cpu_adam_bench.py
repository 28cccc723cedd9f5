"""CPU optimizer step throughput (M params/s): torch AdamW kernels vs our offloaded step vs DeepSpeedCPUAdam.

What an offloaded ZeRO step costs on the host, per parameter, measured side by
side in one process. Every system steps the same fp32 parameters: ``--layers``
(16) tensors of d x d elements, d chosen so the total is about ``--size`` (the
default runs 50M, then 1M):

* ``fused`` / ``foreach`` / ``forloop``: ``torch.optim.AdamW`` with ``fused=True``,
  ``foreach=True``, or neither (the per-tensor loop), on those tensors;
* ``ours`` / ``ours_fp32``: ``zopt.step()`` of a stack of ``--layers``
  ``nn.Linear(d, d, bias=False)`` layers (one unit, hence one flat group, each) set
  up with ``zs.ZeroConfig(stage=2, offload_optimizer="cpu", precision=...)`` in a
  world of one, the user's optimizer being ``AdamW(fused=True)``. Gradients come
  from one backward before timing and stay in place (stage 2 may step again on
  them). Nothing is subtracted: the time is what ``step()`` costs, i.e. the
  gradient hand-over, the per-group CPU AdamW on the worker thread and, with
  ``precision="bf16"`` (``ours``), casting each new fp32 master to the bf16
  parameters through the pinned staging slots (on a CPU-only machine the "upload"
  is a host copy). ``ours_fp32`` masters alias the parameters: AdamW plus the
  engine's overhead only;
* ``ds``: DeepSpeed ``DeepSpeedCPUAdam(adamw_mode=True)`` when ``import deepspeed``
  works (its C++ op is JIT-built with g++ on first use, ~36 s on the 2-core
  machine; reported as ``ds_build_s``, outside every timing);
* ``ds_bf16``: DeepSpeed's offloaded bf16 step as its ZeRO-1/2 engine runs it
  (``runtime/zero/stage_1_and_2.py``, ``cpu_offload``): ``DeepSpeedCPUAdam.step()``,
  then per tensor the fp32 partition cast into the bf16 staging buffer and that copied
  into the bf16 partition (on a CPU-only machine both copies are host copies). It is
  ``ours``'s like-for-like peer: both produce the compute-dtype parameters. (Its gradients
  are fp32: DeepSpeed's engine casts them on the device before they reach the host; ours
  reach it in bf16.)
* ``ours_batch``: ``ours`` without the windowed step (See [Note: the bf16 step in cache-sized
  windows] in src/zero_strategy/_optim/adam_windows.py): the step batch's gradients cast to
  fp32, the user's optimizer over the batch, then the masters cast to bf16, as before it.
* ``adafactor`` / ``muon`` and ``ours_adafactor`` / ``ours_muon``: torch's ``Adafactor`` (lr
  1e-2) and ``Muon`` (lr 0.02), weight decay 0.01, on the plain fp32 tensors, and ``zopt.step()``
  of ``ours`` set up with them instead of AdamW (bf16; both take the ownership layout, each
  tensor stepped whole by the rank that owns it). Not in the default ``--systems``: Muon's
  Newton-Schulz iterations take seconds per step on 2 cores at 50M.

All use lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01. ``--warmup``
steps (the first allocates the optimizer state), then ``--repeats`` rounds in
which every system steps once, the order rotated each round (machine noise falls on
all alike); the table shows the median step time, M params/s and the implied memory
traffic at 28 bytes/param (an AdamW step reads param, grad, m, v and writes param,
m, v: 7 x 4 bytes), and the ratios of ours to the others over the medians and over each
system's best round (on a shared machine the best round is the one least disturbed). Threads: ``--threads`` (default
``torch.get_num_threads()``); DeepSpeed's OpenMP loop uses the same count. The JSON
also records how many intra-op threads our CPU-step worker thread sees.

    python benchmarks/cpu_adam_bench.py                       # 50M and 1M params
    python benchmarks/cpu_adam_bench.py --sizes 100M --threads 16
    /tmp/dsvenv/bin/python benchmarks/cpu_adam_bench.py       # adds DeepSpeedCPUAdam

Writes ``benchmarks/out/cpu_adam_bench.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SYSTEMS = ("fused", "foreach", "forloop", "ours", "ours_batch", "ours_fp32", "ds", "ds_bf16",
           "adafactor", "ours_adafactor", "muon", "ours_muon")
#: the other optimizers' settings (torch's own classes), plain and ours alike
OTHERS = {"adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01),
          "muon": lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.01)}
BYTES_PER_PARAM = 28
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

# this checkout's code, never another installed copy (as hot_path.py): what is measured is the tree
sys.path.insert(0, os.path.join(REPO, "src"))
import zero_strategy as zs  # noqa: E402

import torch
from torch import nn


def parse_size(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="50M,1M", help="comma list of parameter counts (K/M/G suffixes)")
    p.add_argument("--layers", type=int, default=16, help="tensors (and our units) the parameters are split into")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--systems", default=",".join(s for s in SYSTEMS if s.replace("ours_", "") not in OTHERS),
                   help="comma list of " + ",".join(SYSTEMS))
    p.add_argument("--out", default=os.path.join(HERE, "out", "cpu_adam_bench.json"))
    p.add_argument("--split", action="store_true",
                   help="also time the parts of ours' step (after the table; see split_step)")
    a = p.parse_args(argv)
    a.sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in a.systems if s not in SYSTEMS]
    if bad:
        p.error(f"unknown systems {bad}; choose from {SYSTEMS}")
    return a


class Stack(nn.Module):
    """``layers`` bias-free d x d linear layers; each is one unit (a ModuleList child) of our engine."""

    def __init__(self, d: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def make_tensors(d: int, layers: int, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = []
    for _ in range(layers):
        p = nn.Parameter(torch.randn(d, d, generator=g) * 0.02)
        p.grad = torch.randn(d, d, generator=g) * 1e-3
        ps.append(p)
    return ps


class Runner:
    """One system: ``step()`` is what gets timed."""

    def __init__(self, name, step, keep, info=None):
        self.name, self.step, self.keep, self.info = name, step, keep, info or {}
        self.times: list[float] = []


def build(name: str, d: int, layers: int, report: dict) -> Runner:
    if name in ("fused", "foreach", "forloop"):
        ps = make_tensors(d, layers)
        kw = {"fused": {"fused": True}, "foreach": {"foreach": True},
              "forloop": {"foreach": False, "fused": False}}[name]
        opt = torch.optim.AdamW(ps, **HYPER, **kw)
        return Runner(name, opt.step, [ps, opt])
    if name in ("ours", "ours_batch", "ours_fp32"):
        precision = "fp32" if name == "ours_fp32" else "bf16"
        torch.manual_seed(0)
        model = Stack(d, layers)
        opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
        model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=2, offload_optimizer="cpu", precision=precision))
        x = torch.randn(8, d)
        model(x).float().square().mean().backward()  # grads stay in place for every timed step
        engine = zs.api._engine_of(model)
        if name == "ours_batch":  # the step before the windows: the optimizer's own call per step batch
            zopt.offloaded._window_plan = lambda batch: None
        info = {"precision": precision, "groups": len(engine.trainable_groups),
                "worker_thread_intraop_threads": engine.transfers.pool.submit(torch.get_num_threads).result()}
        return Runner(name, zopt.step, [model, opt, zopt], info)
    if name in OTHERS:
        ps = make_tensors(d, layers)
        opt = OTHERS[name](ps)
        return Runner(name, opt.step, [ps, opt])
    if name.startswith("ours_") and name[5:] in OTHERS:  # Adafactor, Muon: the ownership layout
        torch.manual_seed(0)
        model = Stack(d, layers)
        opt = OTHERS[name[5:]](list(model.parameters()))
        model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=2, offload_optimizer="cpu", precision="bf16"))
        model(torch.randn(8, d)).float().square().mean().backward()
        return Runner(name, zopt.step, [model, opt, zopt])
    if name == "ds":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        ps = make_tensors(d, layers)
        opt = DeepSpeedCPUAdam(ps, **HYPER, adamw_mode=True)
        return Runner(name, opt.step, [ps, opt])
    if name == "ds_bf16":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        ps = make_tensors(d, layers)
        opt = DeepSpeedCPUAdam(ps, **HYPER, adamw_mode=True)
        staging = [torch.empty_like(p, dtype=torch.bfloat16) for p in ps]
        bf16 = [torch.empty_like(p, dtype=torch.bfloat16) for p in ps]

        def step():
            opt.step()
            for p, buf, out in zip(ps, staging, bf16):
                buf.copy_(p.data)
                out.copy_(buf, non_blocking=True)
        return Runner(name, step, [ps, opt, staging, bf16])
    raise ValueError(name)


def ds_available(report: dict) -> str | None:
    """None if DeepSpeedCPUAdam can run (building its op now, timed), else why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    try:
        import deepspeed
    except ImportError as e:
        return f"not installed ({e})"
    except Exception as e:  # noqa: BLE001
        return f"import failed ({type(e).__name__}: {str(e)[:120]})"
    report["versions"]["deepspeed"] = deepspeed.__version__
    t0 = time.perf_counter()
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
        CPUAdamBuilder().load()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        return f"CPUAdam build failed ({type(e).__name__}: {str(e)[:120]})"
    report["ds_build_s"] = time.perf_counter() - t0
    print(f"[cpu_adam_bench] DeepSpeed CPUAdam op ready in {report['ds_build_s']:.1f} s (JIT build or cache)",
          flush=True)
    return None


def run_size(n_target: int, a, report: dict, skipped: dict) -> dict:
    d = max(1, round(math.sqrt(n_target / a.layers)))
    n = d * d * a.layers
    out = {"target": n_target, "params": n, "layers": a.layers, "d": d, "systems": {}}
    runners: list[Runner] = []
    for name in a.systems:
        if name in skipped:
            out["systems"][name] = {"status": skipped[name]}
            continue
        try:
            runners.append(build(name, d, a.layers, report))
        except Exception as e:  # noqa: BLE001 - record, go on
            traceback.print_exc()
            out["systems"][name] = {"status": f"error: {type(e).__name__}: {e}"[:300]}
    for r in runners:
        for _ in range(a.warmup):
            r.step()
    for k in range(a.repeats):
        shift = k % max(1, len(runners))
        for r in runners[shift:] + runners[:shift]:
            t0 = time.perf_counter()
            r.step()
            r.times.append(time.perf_counter() - t0)
    for r in runners:
        med = statistics.median(r.times)
        out["systems"][r.name] = {"status": "ok", "step_s": med, "best_s": min(r.times), "times_s": r.times,
                                  "mparams_per_s": n / med / 1e6,
                                  "gbytes_per_s_at_28B": BYTES_PER_PARAM * n / med / 1e9, **r.info}
    fused = out["systems"].get("fused", {}).get("step_s")
    for s in out["systems"].values():
        if "step_s" in s and fused:
            s["vs_fused"] = s["step_s"] / fused
    for r in runners:
        r.keep.clear()
    runners.clear()
    gc.collect()
    return out


def split_step(n_target: int, layers: int, precision: str, repeats: int) -> dict:
    """Where ``zopt.step()`` spends its time: ms per step in each part, timed by wrapping them.

    Worker thread: ``master_grad`` (the gradient hand-over: a download or cast into the
    host buffer, or nothing when the shard is used in place), ``optimizer`` (the user's
    optimizer calls), ``upload`` (master -> compute-dtype parameters). Main thread:
    ``gather`` (issuing the stage-1/2 all-gathers; nothing moves in a world of one).
    ``other`` = the step minus the worker's parts (hand-offs, waits, bookkeeping).
    """
    from zero_strategy._engine import flat as _flat
    d = max(1, round(math.sqrt(n_target / layers)))
    spent: dict[str, float] = {}

    def timed(obj, attr, key):
        fn = getattr(obj, attr)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
        return wrapper

    originals = {a: getattr(_flat.FlatGroup, a) for a in ("master_grad", "stage_master_upload", "gather_replicated")}
    try:
        for attr, key in (("master_grad", "master_grad"), ("stage_master_upload", "upload"),
                          ("gather_replicated", "gather")):
            setattr(_flat.FlatGroup, attr, timed(_flat.FlatGroup, attr, key))
        torch.manual_seed(0)
        model = Stack(d, layers)
        opt = torch.optim.AdamW(model.parameters(), **HYPER, fused=True)
        model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=2, offload_optimizer="cpu", precision=precision))
        zopt._unhooked_step = timed(zopt, "_unhooked_step", "optimizer")
        model(torch.randn(8, d)).float().square().mean().backward()
        for _ in range(2):
            zopt.step()
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(repeats):
            zopt.step()
        total = time.perf_counter() - t0
        out = {k: v / repeats * 1e3 for k, v in spent.items()}
        out["step"] = total / repeats * 1e3
        out["other"] = out["step"] - sum(out.get(k, 0.0) for k in ("master_grad", "optimizer", "upload", "gather"))
        zs.teardown(model)
        return out
    finally:
        for attr, fn in originals.items():
            setattr(_flat.FlatGroup, attr, fn)


def format_table(report: dict) -> str:
    lines = [f"CPU AdamW step, fp32, {report['threads']} threads ({report['host']['cpus']} CPUs), median of "
             f"{report['repeats']} after {report['warmup']} warm-up; M params/s (higher is better)"]
    head = f"{'system':<10}" + "".join(f"{'%.1fM params' % (r['params'] / 1e6):>30}" for r in report["sizes"])
    sub = f"{'':<10}" + "".join(f"{'ms/step':>10}{'M/s':>8}{'GB/s@28B':>12}" for _ in report["sizes"])
    lines += [head, sub, "-" * len(sub)]
    for name in report["systems"]:
        row = f"{name:<10}"
        for size in report["sizes"]:
            s = size["systems"].get(name, {})
            if "step_s" in s:
                row += f"{s['step_s'] * 1e3:>10.2f}{s['mparams_per_s']:>8.0f}{s['gbytes_per_s_at_28B']:>12.1f}"
            else:
                row += f"{s.get('status', '-')[:28]:>30}"
        lines.append(row)
    for size in report["sizes"]:
        ours = size["systems"].get("ours", {})
        if "worker_thread_intraop_threads" in ours:
            lines.append(f"ours @ {size['params'] / 1e6:.1f}M: {ours['groups']} groups; the CPU-step worker thread "
                         f"sees {ours['worker_thread_intraop_threads']} intra-op threads")
            break
    lines.append("fused/foreach/forloop: torch.optim.AdamW; ours: zopt.step() of ZeroConfig(stage=2, "
                 "offload_optimizer='cpu', precision='bf16') (fused AdamW + bf16 cast of the masters); ours_fp32: "
                 "the same with fp32 params (on a CUDA-less machine the masters are the parameters); "
                 "ds: DeepSpeedCPUAdam(adamw_mode=True); ds_bf16: its step plus the bf16 copy-out its ZeRO "
                 "engine does with cpu_offload (cast into a bf16 buffer, copied into the bf16 partition).")
    for size in report["sizes"]:
        sy = size["systems"]
        pairs = [("ours_fp32", "ds"), ("ours", "ds"), ("ours", "ds_bf16"), ("ours_batch", "ds_bf16"),
                 ("ours", "fused"), ("ours_batch", "fused"), ("ours_adafactor", "adafactor"), ("ours_muon", "muon")]
        for stat, label in (("step_s", "medians"), ("best_s", "best rounds")):
            got = [f"{a} / {b} {sy[b][stat] / sy[a][stat]:.2f}x" for a, b in pairs
                   if stat in sy.get(a, {}) and stat in sy.get(b, {})]
            if got:
                lines.append(f"rate of ours vs the others @ {size['params'] / 1e6:.1f}M, {label} (>= 1 is at least "
                             "as fast): " + "; ".join(got))
    if report.get("ds_build_s") is not None:
        lines.append(f"DeepSpeed CPUAdam op build/load: {report['ds_build_s']:.1f} s (not timed)")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    report = {
        "benchmark": "cpu_adam_bench", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": f"{os.path.basename(sys.executable)} benchmarks/cpu_adam_bench.py " + " ".join(sys.argv[1:]),
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor()},
        "threads": torch.get_num_threads(), "warmup": a.warmup, "repeats": a.repeats,
        "versions": {"torch": torch.__version__, "zero_strategy": zs.__version__, "python": sys.version.split()[0]},
        "systems": a.systems, "sizes": [],
    }
    skipped = {}
    if {"ds", "ds_bf16"} & set(a.systems):
        why = ds_available(report)
        if why:
            skipped["ds"] = skipped["ds_bf16"] = why
            print(f"[cpu_adam_bench] ds: {why}", flush=True)
    for n in a.sizes:
        t0 = time.perf_counter()
        report["sizes"].append(run_size(n, a, report, skipped))
        print(f"[cpu_adam_bench] {n / 1e6:.1f}M params done in {time.perf_counter() - t0:.0f} s", flush=True)
    print(format_table(report), flush=True)
    if a.split:
        report["split_ms"] = {}
        parts = ("master_grad", "optimizer", "upload", "gather", "other", "step")
        print(f"ours' step split, ms per step (mean of {a.repeats}): " + "  ".join(f"{p:>11}" for p in parts))
        for n in a.sizes:
            for precision in ("fp32", "bf16"):
                sp = split_step(n, a.layers, precision, a.repeats)
                report["split_ms"][f"{n}/{precision}"] = sp
                print(f"  {n / 1e6:6.1f}M {precision:<4}                          "
                      + "  ".join(f"{sp.get(p, 0.0):>11.2f}" for p in parts), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"cpu_adam_bench: wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
