"""CPU benchmark: the time ``zero_strategy.setup`` takes on a model of many small parameter tensors,
beside torch DDP's construction on the same model, 2 ranks, gloo.

Two models of ``N`` one-element parameters (what a mixture of experts with tens of thousands of
parameter tensors looks like to setup, without the bytes):

* ``params``: one module holding an ``nn.ParameterList`` of N parameters (one flat group);
* ``experts``: an ``nn.ModuleList`` of N/4 small experts of 4 one-element parameters each (each
  member of the list gets flat groups of its own at stages 1-2, a unit of its own at stage 3).

Per model and size the systems take turns in the same process (DDP, then stages 1, 2, 3 of
``zero_strategy.setup`` with AdamW, each on a fresh copy of the same weights); each figure is the
median over rounds of the slower rank's wall time, with the ratio to DDP's beside it. The machine
is shared: compare the ratios, not the absolutes.

Usage (from the repository root)::

    python benchmarks/setup_bench.py                            # N = 10,000 and 50,000, 3 rounds
    python benchmarks/setup_bench.py --sizes 10000 --rounds 1   # quick check

It re-launches itself with ``python -m torch.distributed.run --nproc-per-node 2``; rank 0 prints
the table and writes ``benchmarks/out/setup_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, "out", "setup_bench.json")
SYSTEMS = ("ddp", "stage1", "stage2", "stage3")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=int, default=[10_000, 50_000])
    p.add_argument("--models", nargs="+", default=["params", "experts"], choices=["params", "experts"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def launch(args) -> int:
    """Run this script under torch.distributed.run; success is the JSON rank 0 writes."""
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if os.path.exists(args.out):
        os.remove(args.out)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__), "--worker", "--out", args.out, "--rounds", str(args.rounds),
           "--sizes", *map(str, args.sizes), "--models", *args.models]
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    rc = subprocess.call(cmd, env=env)
    return rc if rc else (0 if os.path.exists(args.out) else 1)


def build(kind: str, n: int):
    import torch
    from torch import nn

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.b1, self.w2, self.b2 = (nn.Parameter(torch.randn(1)) for _ in range(4))

        def forward(self, x):
            return (x * self.w1 + self.b1) * self.w2 + self.b2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            if kind == "params":
                self.ps = nn.ParameterList(nn.Parameter(torch.randn(1)) for _ in range(n))
            else:
                self.experts = nn.ModuleList(Expert() for _ in range(n // 4))

        def forward(self, x):
            ps = self.ps if kind == "params" else [e.w1 for e in self.experts]
            return x * sum(ps)

    torch.manual_seed(0)
    return Model()


def timed(fn) -> float:
    import torch.distributed as dist
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()  # the slower rank's time
    return time.perf_counter() - t


def one(system: str, kind: str, n: int) -> float:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs

    model = build(kind, n)
    if system == "ddp":
        return timed(lambda: DDP(model))
    opt = torch.optim.AdamW(model.parameters())
    seconds = timed(lambda: zs.setup(model, opt, {"stage": int(system[-1])}))
    zs.teardown(model, keep_weights=False)
    return seconds


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rows = []
    for kind in args.models:
        for n in args.sizes:
            times = {s: [] for s in SYSTEMS}
            for _ in range(args.rounds):
                for system in SYSTEMS:
                    times[system].append(one(system, kind, n))
            med = {s: statistics.median(v) for s, v in times.items()}
            rows.append(dict(model=kind, params=n, seconds=med,
                             ratio_to_ddp={s: med[s] / med["ddp"] for s in SYSTEMS},
                             load_avg=os.getloadavg()[0]))
            if dist.get_rank() == 0:
                r = rows[-1]
                print(f"{kind:8s} {n:>7,d} params  " + "  ".join(
                    f"{s} {r['seconds'][s]:6.2f} s ({r['ratio_to_ddp'][s]:.2f}x)" for s in SYSTEMS)
                    + f"  load {r['load_avg']:.1f}", flush=True)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(dict(nproc=dist.get_world_size(), rounds=args.rounds, rows=rows), f, indent=1)
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
