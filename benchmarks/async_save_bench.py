"""CPU benchmark: what a checkpoint save every K steps costs training, synchronous against asynchronous
(against torch.distributed.checkpoint's ``async_save`` on the same model), 2 ranks, gloo.

The model is a stack of ``--layers`` square Linear layers of width ``--width`` (default 16 x 1024:
16.8M parameters, 201 MB of fp32 masters and AdamW moments over the 2 ranks), trained at stage 2
with AdamW. Each system trains ``--steps`` steps and saves after every ``--every`` steps except the
last step, so each asynchronous write has ``--every`` steps to overlap with:

* ``none``: no save (our engine): the baseline of ``sync`` and ``async``;
* ``sync``: ``zero_strategy.save_checkpoint(...)``;
* ``async``: ``zero_strategy.save_checkpoint(..., async_save=True)``; the run ends with
  ``wait_for_save`` (counted: a save's cost includes any wait it causes);
* ``ddp_none`` / ``dcp_async`` (``--no-dcp`` skips them): the same model under torch DDP with
  torch's AdamW, without saves and with ``torch.distributed.checkpoint.async_save`` of
  ``{"model": ..., "optim": ...}`` (a gloo group of its own; the previous future awaited before the
  next save, and at the end), the same bytes per save.

A save's cost is (the run's wall time - its baseline's) / saves; the target of issue 42 is an
asynchronous save costing at most 10% of the synchronous save's. The systems take turns, the order
rotated each round; each figure is the median over rounds of the slower rank's, with the 1-minute
load average before and after. The machine is shared (2 cores, other jobs): compare the ratios of one
run only.

Usage (from the repository root)::

    python benchmarks/async_save_bench.py                       # 3 rounds, 16 steps, a save every 5
    python benchmarks/async_save_bench.py --rounds 1 --steps 6 --every 3 --width 256   # quick check

It re-launches itself under ``torch.distributed.run --nproc-per-node 2`` (``--ranks``); rank 0 prints
the table and writes ``benchmarks/out/async_save_bench.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, "out", "async_save_bench.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--every", type=int, default=5, help="save after every this many steps")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="ranks (2 fill this machine's 2 cores; 1 leaves the "
                   "writer a core)")
    p.add_argument("--no-dcp", action="store_true", help="skip the DDP + DCP async_save systems")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def launch(args) -> int:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if os.path.exists(args.out):
        os.remove(args.out)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    subprocess.run(cmd, env=env, cwd=REPO, timeout=1800)
    return 0 if os.path.exists(args.out) else 1


def build(args):
    import torch

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


class Run:
    """One system's model and optimizer, and how it saves."""

    def __init__(self, name: str, args, root: str, gloo_group):
        import torch
        import zero_strategy as zs

        self.name, self.args, self.root = name, args, root
        model = build(args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if name.startswith("ddp") or name.startswith("dcp"):
            self.model = torch.nn.parallel.DistributedDataParallel(model)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        else:
            self.model, self.optimizer = zs.setup(model, optimizer, zs.ZeroConfig(stage=2))
        self.group, self.future, self.saves = gloo_group, None, 0

    def step(self, x) -> None:
        loss = self.model(x).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def save(self) -> None:
        import zero_strategy as zs

        path = os.path.join(self.root, f"{self.name}-{self.saves % 2}")
        self.saves += 1
        if self.name in ("sync", "async"):
            zs.save_checkpoint(path, self.model, self.optimizer, async_save=self.name == "async")
        elif self.name == "dcp_async":
            import torch.distributed.checkpoint as dcp

            if self.future is not None:
                self.future.result()
            state = {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}
            self.future = dcp.async_save(state, checkpoint_id=path, process_group=self.group)

    def finish(self) -> None:
        import zero_strategy as zs

        if self.name == "async":
            zs.checkpoint.wait_for_save(self.model)
        elif self.future is not None:
            self.future.result()
            self.future = None


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import warnings

    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # DCP overwrites its own, as we do
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    gloo_group = dist.new_group(backend="gloo")
    root = args.dir or (tempfile.mkdtemp(prefix="async_save_bench-") if rank == 0 else None)
    holder = [root]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    systems = ["none", "sync", "async"] + ([] if args.no_dcp else ["ddp_none", "dcp_async"])
    runs = {name: Run(name, args, root, gloo_group) for name in systems}
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    for run in runs.values():  # warm-up: one step and, where it saves, one save
        run.step(x)
        run.save()
        run.finish()
    load_before = os.getloadavg()[0]
    walls: dict[str, list[float]] = {s: [] for s in systems}
    save_calls: dict[str, list[float]] = {s: [] for s in systems}
    saves_per_run = len([s for s in range(1, args.steps) if s % args.every == 0])
    for r in range(args.rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for name in order:
            run = runs[name]
            dist.barrier()
            began = time.perf_counter()
            in_save = 0.0
            for step in range(1, args.steps + 1):
                run.step(x)
                if step % args.every == 0 and step < args.steps and name not in ("none", "ddp_none"):
                    t = time.perf_counter()
                    run.save()
                    in_save += time.perf_counter() - t
            run.finish()
            wall = time.perf_counter() - began
            slowest = [0.0, 0.0]
            dist.all_reduce(t := torch.tensor([wall, in_save], dtype=torch.float64), op=dist.ReduceOp.MAX)
            slowest = t.tolist()
            walls[name].append(slowest[0])
            save_calls[name].append(slowest[1])
    load_after = os.getloadavg()[0]
    if rank == 0:
        report(args, systems, walls, save_calls, saves_per_run, load_before, load_after, root)
    dist.barrier()
    if rank == 0 and args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def report(args, systems, walls, save_calls, saves, load_before, load_after, root) -> None:
    med = {s: statistics.median(walls[s]) for s in systems}
    call = {s: statistics.median(save_calls[s]) / max(1, saves) for s in systems}
    base = {"sync": "none", "async": "none", "dcp_async": "ddp_none"}
    cost = {s: (med[s] - med[base[s]]) / saves for s in systems if s in base}
    rank_bytes = sum(os.path.getsize(os.path.join(root, "sync-0", f)) for f in os.listdir(os.path.join(root, "sync-0")))
    rows = [f"{'system':<11}{'run s':>9}{'per step ms':>13}{'save call ms':>14}{'save cost ms':>14}{'cost / sync':>13}"]
    for s in systems:
        c = cost.get(s)
        rows.append(f"{s:<11}{med[s]:>9.3f}{1e3 * med[s] / args.steps:>13.1f}"
                    f"{(1e3 * call[s]) if s in base else float('nan'):>14.1f}"
                    f"{(1e3 * c) if c is not None else float('nan'):>14.1f}"
                    f"{(c / cost['sync']) if c is not None and cost['sync'] > 0 else float('nan'):>13.3f}")
    print("\n".join(rows))
    print(f"{args.ranks} rank(s); {saves} saves per run of {args.steps} steps; checkpoint "
          f"{rank_bytes / 2**20:.1f} MiB; "
          f"load average {load_before:.2f} before, {load_after:.2f} after")
    out = {"settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
           "saves_per_run": saves, "checkpoint_bytes": rank_bytes, "wall_s": walls, "save_call_s": save_calls,
           "median_wall_s": med, "save_cost_s": cost, "save_call_median_s": call,
           "async_cost_over_sync": cost["async"] / cost["sync"] if cost["sync"] > 0 else None,
           "load_average": [load_before, load_after]}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    else:
        sys.exit(launch(a))
