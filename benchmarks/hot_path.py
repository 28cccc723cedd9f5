"""The hot-path guard: the ratios that a change to the step, the collectives or the host-memory
code can spoil, measured side by side in one run, in under a minute on a 2-core machine.

    python benchmarks/hot_path.py            # prints the table, writes benchmarks/out/hot_path.json

Run it before and after any such change and record both in benchmarks/RESULTS.md (docs/testing.md,
"The hot-path guard"). Every figure is a ratio of two things timed in the same process, interleaved
(one of each per round, the median over the rounds), so machine noise falls on both alike; an
absolute time means little on a shared machine. Higher is better; 1.0 is the reference's speed.

* ``offloaded step, fp32``: ``optimizer.step()`` of ``zero_strategy.setup(..., {"stage": 2,
  "offload_optimizer": "cpu"})`` with ``AdamW(fused=True)``, 48M fp32 parameters in 12 blocks (one
  flat group each), against ``torch.optim.AdamW(fused=True)`` on tensors of the same sizes in
  plain memory. Target: at least 0.9.
* ``offloaded step, bf16``: the same with ``precision="bf16"`` (fp32 masters, the bf16 gradients
  cast to fp32, the new bf16 parameters written back), against the same fused AdamW on fp32.
* ``offloaded iteration``: forward, backward, ``step()`` and ``zero_grad()`` of that fp32 model
  against the same loop on the plain model with the fused AdamW: what a release or an allocation
  between steps costs shows here even when the step alone does not show it.
* ``stage-3 iteration vs DDP, 2 ranks``: one forward, backward and step of a 4-block model at
  ``zero3`` against ``DistributedDataParallel`` with the same AdamW, both in the same two gloo
  processes, alternating.

The load average is printed beside every figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) * 0.01)

    def forward(self, x):
        return x + torch.tanh(x @ self.w)


class Net(nn.Module):
    def __init__(self, blocks: int, dim: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))  # one unit, one flat group each

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def _load() -> float:
    return round(os.getloadavg()[0], 1)


#: untimed rounds before the timed ones (the first allocates the optimizer state)
WARMUP = 2


def interleaved(ours, reference, rounds: int) -> dict:
    """``ours()`` and ``reference()`` (each returns the seconds it timed) one after the other per
    round; the ratio of the medians over the timed rounds, with the load average."""
    ours_t, ref_t = [], []
    for i in range(rounds + WARMUP):
        dt, dr = ours(), reference()
        if i >= WARMUP:
            ours_t.append(dt)
            ref_t.append(dr)
    ours_ms, ref_ms = statistics.median(ours_t), statistics.median(ref_t)
    return {"ratio": round(ref_ms / ours_ms, 3), "ours_ms": round(1e3 * ours_ms, 1),
            "reference_ms": round(1e3 * ref_ms, 1), "load": _load()}


def _timed_iteration(model, optimizer, x, before=lambda: None) -> float:
    """Seconds of one forward, backward, step and ``zero_grad``."""
    before()
    t = time.perf_counter()
    model(x).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - t


def offloaded_step(precision: str, blocks: int, dim: int, rounds: int) -> dict:
    """Ours' ``step()`` against torch's fused AdamW over the same sizes, interleaved."""
    import zero_strategy as zs
    torch.manual_seed(0)
    model = Net(blocks, dim)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = zs.setup(model, opt, {"stage": 2, "offload_optimizer": "cpu", "precision": precision})
    x = torch.randn(8, dim)
    ref = [torch.randn(dim, dim) for _ in range(blocks)]
    for p in ref:
        p.grad = torch.randn_like(p)
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, fused=True)

    def ours() -> float:
        model(x).backward()
        t = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t
        opt.zero_grad()
        return dt

    def reference() -> float:
        t = time.perf_counter()
        ref_opt.step()
        return time.perf_counter() - t

    row = interleaved(ours, reference, rounds)
    zs.teardown(model)  # its worker thread and buffers go before the next figure
    return row


def offloaded_iteration(blocks: int, dim: int, rounds: int) -> dict:
    """A whole training iteration with the CPU-offloaded step against the plain model's."""
    import zero_strategy as zs
    torch.manual_seed(0)
    plain = Net(blocks, dim)
    ours = Net(blocks, dim)
    ours.load_state_dict(plain.state_dict())
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3, fused=True)
    ours, opt = zs.setup(ours, opt, {"stage": 2, "offload_optimizer": "cpu"})
    x = torch.randn(8, dim)
    row = interleaved(lambda: _timed_iteration(ours, opt, x), lambda: _timed_iteration(plain, plain_opt, x), rounds)
    zs.teardown(ours)
    return row


def _stage3_worker(rank: int, world: int, port: int, blocks: int, dim: int, rounds: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_strategy as zs
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ref_model = Net(blocks, dim)
    ours = Net(blocks, dim)
    ours.load_state_dict(ref_model.state_dict())
    ddp = DDP(ref_model)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, fused=True)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3, fused=True)
    ours, opt = zs.setup(ours, opt, "zero3")
    x = torch.randn(8, dim, generator=torch.Generator().manual_seed(rank))
    row = interleaved(lambda: _timed_iteration(ours, opt, x, dist.barrier),
                      lambda: _timed_iteration(ddp, ddp_opt, x, dist.barrier), rounds)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()
    os._exit(0)


def stage3_vs_ddp(blocks: int, dim: int, rounds: int, workdir: str) -> dict:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(workdir, "stage3_vs_ddp.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_stage3_worker, args=(r, 2, port, blocks, dim, rounds, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        if p.is_alive():
            p.kill()
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per figure (median), after 2 warm-ups")
    p.add_argument("--out", default=os.path.join(HERE, "out", "hot_path.json"))
    args = p.parse_args(argv)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    started = time.perf_counter()
    rows = {
        "offloaded step, fp32 (stage 2, 48M params) / torch fused AdamW": offloaded_step("fp32", 12, 2000, args.rounds),
        "offloaded step, bf16 (stage 2, 48M params) / torch fused AdamW on fp32": offloaded_step("bf16", 12, 2000,
                                                                                                args.rounds),
        "offloaded iteration (stage 2, 48M params) / plain model with fused AdamW": offloaded_iteration(12, 2000,
                                                                                                        args.rounds),
        "stage-3 iteration / DDP, 2 ranks (4 blocks, 4M params)": stage3_vs_ddp(4, 1000, args.rounds,
                                                                                os.path.dirname(args.out)),
    }
    width = max(len(k) for k in rows)
    print(f"{'ratio (higher is better; 1.0 = the reference)':{width}}  ratio   ours ms   ref ms  load")
    for name, r in rows.items():
        print(f"{name:{width}}  {r['ratio']:5.2f}  {r['ours_ms']:8.1f}  {r['reference_ms']:7.1f}  {r['load']:4.1f}")
    report = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cpus": os.cpu_count(),
              "seconds": round(time.perf_counter() - started, 1), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"({report['seconds']} s; {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
