"""Where an offloaded step's time goes: forward, backward and step, and the disk bytes.

The systems of ``cpu_bench.py --offload`` (same model, batches, round-robin order and
DeepSpeed setups), with each step split into forward / backward / optimizer step (max
over ranks, median over the timed steps) and the bytes this process read from and wrote
to disk per step (``/proc/self/io``; O_DIRECT requests count there, page-cache hits do
not). Adds ``zero2_nvme`` (stage 2, optimizer state on NVMe), which has no preset.

Usage (from the repository root)::

    python benchmarks/offload_phases.py                      # the offload presets and DeepSpeed's
    python benchmarks/offload_phases.py --systems zero3_offload_nvme,ds3_nvme --rounds 6

It re-launches itself with ``torch.distributed.run`` on 2 ranks; rank 0 prints the
table and writes ``benchmarks/out/offload_phases.json``. Note the load average beside
the figures: only ratios measured in one run mean anything on a shared machine.
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
sys.path.insert(0, HERE)
import cpu_bench  # noqa: E402  (the model, batches, systems and DeepSpeed setups)

DEFAULT_SYSTEMS = "zero2_offload,zero3_offload,zero3_offload_nvme,zero2_nvme,ds2_offload,ds3_offload,ds3_nvme"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=DEFAULT_SYSTEMS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="timed steps per system per round")
    p.add_argument("--out", default=os.path.join(HERE, "out", "offload_phases.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _disk_bytes() -> tuple[int, int]:
    fields = dict(line.split(":") for line in open("/proc/self/io"))
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _build(name, bench_args):
    if name != "zero2_nvme":
        return cpu_bench._build(name, bench_args)
    import zero_strategy as zs
    system = cpu_bench.System(name)
    model = cpu_bench._make_model(bench_args)
    cfg = zs.ZeroConfig(stage=2, offload_optimizer=zs.NVMeOffload(path=cpu_bench._nvme_dir(bench_args, name)))
    system.model, system.opt = zs.setup(model, cpu_bench._make_optimizer(model.parameters(), bench_args), cfg)
    return system


def _phases(name, system, ids):
    """(forward, backward, step) seconds of one training step."""
    t0 = time.perf_counter()
    if name.startswith("ds"):
        loss = system.engine(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        system.engine.backward(loss)
        t2 = time.perf_counter()
        system.engine.step()
    else:
        loss = system.model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        if hasattr(system.opt, "backward"):  # ours; DDP's plain torch optimizer has none
            system.opt.backward(loss)
        else:
            loss.backward()
        t2 = time.perf_counter()
        system.opt.step()
        system.opt.zero_grad()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    ds = any(n.startswith("ds") for n in names)
    if ds:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    bench_args = cpu_bench.parse_args(["--layers", str(args.layers), "--embd", str(args.embd), "--worker"])
    systems = [(n, _build(n, bench_args)) for n in names]
    samples = {n: [] for n in names}
    done = dict.fromkeys(names, 0)

    def run(name, system, keep):
        ids = cpu_bench._batch(bench_args, done[name], rank)
        done[name] += 1
        dist.barrier()
        r0, w0 = _disk_bytes()
        fwd, bwd, step = _phases(name, system, ids)
        r1, w1 = _disk_bytes()
        if keep:
            samples[name].append((fwd, bwd, step, fwd + bwd + step, r1 - r0, w1 - w0))

    for name, system in systems:  # warm-up: the optimizer state exists from the second step
        for _ in range(2):
            run(name, system, keep=False)
    for r in range(args.rounds):
        for name, system in systems[r % len(systems):] + systems[:r % len(systems)]:
            for _ in range(args.steps):
                run(name, system, keep=True)

    rows = []
    for name in names:
        t = torch.tensor(samples[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        med = [statistics.median(col) for col in zip(*t.tolist())]
        rows.append({"system": name, "forward_ms": med[0] * 1e3, "backward_ms": med[1] * 1e3,
                     "step_ms": med[2] * 1e3, "total_ms": med[3] * 1e3,
                     "read_mb_per_step": med[4] / 1e6, "written_mb_per_step": med[5] / 1e6})
    if rank == 0:
        load = os.getloadavg()
        header = f"{'system':20s} {'forward':>8s} {'backward':>9s} {'step':>7s} {'total':>7s} {'read MB':>8s} {'written MB':>11s}"
        print(f"GPT-2 {args.layers}L/{args.embd}, 2 gloo ranks, ms per step (max over ranks, median of "
              f"{args.rounds}x{args.steps}); disk bytes per step per rank; load average at end "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        print(header)
        print("-" * len(header))
        for r in rows:
            print(f"{r['system']:20s} {r['forward_ms']:8.1f} {r['backward_ms']:9.1f} {r['step_ms']:7.1f} "
                  f"{r['total_ms']:7.1f} {r['read_mb_per_step']:8.1f} {r['written_mb_per_step']:11.1f}")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"benchmark": "offload_phases", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "model": {"layers": args.layers, "embd": args.embd}, "rounds": args.rounds,
                       "steps_per_round": args.steps, "loadavg_at_end": load, "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # the known gloo exit flake: leave without interpreter teardown


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(cpu_bench._free_port()),
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    return subprocess.call(cmd, cwd=os.path.dirname(HERE))


if __name__ == "__main__":
    raise SystemExit(main())
