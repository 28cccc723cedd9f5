"""CPU benchmark: per-rank memory of loading a mixture-of-experts checkpoint and setting it up at
stage 3, 2 ranks, gloo: ``zero_strategy.transformers.from_pretrained`` + ``setup`` beside
transformers' ``from_pretrained`` + ``setup`` (every rank reads the whole model), and beside
FSDP2's usual load (rank 0 reads the model with ``from_pretrained``, the others build it on the
meta device; ``fully_shard`` per decoder layer and the root, then ``set_model_state_dict`` with
``broadcast_from_rank0=True``).

A Mixtral (8 experts per layer, its per-expert tensors on disk as transformers saves them) is
written once in fp32; each system then runs in fresh processes. Each rank samples its
anonymous resident memory (``RssAnon``) in a thread from just before loading to just after
``setup`` (with AdamW, ``zero3``) and reports the peak and the end above its baseline (after
imports), in multiples of W (the fp32 weights), split into the load (``from_pretrained``) and
``setup`` phases, with the bytes it read through the loader's safetensors reads (ours only)
checked against its share of the checkpoint's files plus its largest tensor. The machine is
shared: the load average is printed with the results.

Usage (from the repository root)::

    python benchmarks/moe_load_bench.py                     # hidden 512, 8 layers: about 140M parameters
    python benchmarks/moe_load_bench.py --layers 2          # quick check
    python benchmarks/moe_load_bench.py --hidden 1024 --intermediate 2048 --layers 18   # about 1.03B

Before transformers' comparator (every rank holds the whole model) it checks ``MemAvailable``
against an estimate of its peak (1.5 W per rank) and skips it, saying so, where that does not fit;
``--systems`` picks the systems to run.

It re-launches itself with ``python -m torch.distributed.run --nproc-per-node 2`` per system;
the table is printed and ``benchmarks/out/moe_load_bench.json`` written.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, "out", "moe_load_bench.json")
SYSTEMS = ("ours", "transformers", "fsdp2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--report", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def anon_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def checkpoint_tensors(directory: str) -> list[int]:
    """The byte size of every tensor in the checkpoint's safetensors files, read from their headers."""
    import glob
    import struct

    sizes = []
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        sizes += [hi - lo for name, t in header.items() if name != "__metadata__" for lo, hi in [t["data_offsets"]]]
    return sizes


class Sampler:
    """The process's anonymous RSS every ``interval`` seconds; ``peak`` since it started."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak, self._stop = interval, anon_rss(), threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            with self._lock:
                self.peak = max(self.peak, anon_rss())
            time.sleep(self.interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, anon_rss())

    def restart(self) -> int:
        """The peak so far; the next phase's peak starts from now."""
        with self._lock:
            peak, self.peak = max(self.peak, anon_rss()), anon_rss()
        return peak


def write_checkpoint(args, directory: str) -> int:
    """A Mixtral saved by transformers (one tensor per expert); returns its parameter count."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                           num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import zero_strategy as zs
    from zero_strategy.checkpoint import _sharded_weights
    from zero_strategy.transformers import from_pretrained

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    read = {"bytes": 0}
    original = _sharded_weights._SafetensorsReader._slice

    class Counted:
        def __init__(self, sl):
            self.sl = sl

        def get_shape(self):
            return self.sl.get_shape()

        def get_dtype(self):
            return self.sl.get_dtype()

        def __getitem__(self, index):
            values = self.sl[index]
            read["bytes"] += values.numel() * values.element_size()
            return values

    _sharded_weights._SafetensorsReader._slice = lambda self, c: (lambda s: None if s is None else Counted(s))(
        original(self, c))
    dist.barrier()
    baseline = anon_rss()
    sampler = Sampler()
    start = time.perf_counter()
    if args.worker == "fsdp2":
        share, load_peak = fsdp2_load(args.dir, rank, sampler)
    else:
        if args.worker == "ours":
            model = from_pretrained(AutoModelForCausalLM, args.dir)
        else:
            model = AutoModelForCausalLM.from_pretrained(args.dir)
        load_peak = sampler.restart()
        model, _ = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), "zero3")
        engine = zs.api._engine_of(model)
        share = sum((hi - lo) * 4 for g in engine.groups for _, lo, hi, _ in g.slot_ranges_in_shard())
    seconds = time.perf_counter() - start
    peak = sampler.stop() - baseline
    after = anon_rss() - baseline
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, dict(rank=rank, peak_anon=max(peak, load_peak - baseline),
                                      load_peak_anon=load_peak - baseline, setup_peak_anon=peak,
                                      after_anon=after, seconds=seconds,
                                      bytes_read=read["bytes"] if args.worker == "ours" else None, share=share))
    if rank == 0:
        with open(args.report, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def fsdp2_load(directory: str, rank: int, sampler: Sampler) -> tuple[int, int]:
    """FSDP2's usual rank-0 load and broadcast; returns this rank's bytes of parameters (its shards)
    and the peak of its load phase (``from_pretrained`` on rank 0; the meta model elsewhere)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    if rank == 0:
        model = AutoModelForCausalLM.from_pretrained(directory)
        full = model.state_dict()
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
        full = {}
    load_peak = sampler.restart()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if rank != 0:  # (its rotary frequencies, computed rather than loaded, would be recomputed before use:
        model.to_empty(device="cpu")  # a few hundred bytes, which the memory measured here does not see)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    torch.optim.AdamW(model.parameters(), lr=1e-4)
    return sum(p.to_local().numel() * 4 for p in model.parameters()), load_peak


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    systems = [s for s in args.systems.split(",") if s]
    skipped = {}
    with tempfile.TemporaryDirectory(prefix="moe_load_bench_") as tmp:
        params = write_checkpoint(args, os.path.join(tmp, "ckpt"))
        tensors = checkpoint_tensors(os.path.join(tmp, "ckpt"))
        w = 4 * params
        load = [os.getloadavg()]
        results = {}
        for system in systems:
            need = int(1.5 * w * args.nproc) if system == "transformers" else 0
            if need and mem_available() < need + 2**31:
                skipped[system] = (f"skipped: MemAvailable {mem_available() / 2**30:.1f} GiB < its estimated "
                                   f"{need / 2**30:.1f} GiB (1.5 W per rank) + 2 GiB")
                print(system, skipped[system])
                continue
            report = os.path.join(tmp, f"{system}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
                   os.path.abspath(__file__), "--worker", system, "--dir", os.path.join(tmp, "ckpt"),
                   "--report", report]
            subprocess.run(cmd, env=env, check=True)
            with open(report) as f:
                results[system] = json.load(f)
            load.append(os.getloadavg())
    file_share, largest = sum(tensors) / args.nproc, max(tensors)
    lines = [f"Mixtral, hidden {args.hidden}, intermediate {args.intermediate}, {args.experts} experts, "
             f"{args.layers} layers: {params / 1e6:.1f}M parameters, W = {w / 1e9:.3f} GB (fp32); "
             f"{args.nproc} ranks, zero3 with AdamW; files {sum(tensors) / 1e9:.3f} GB, largest tensor "
             f"{largest / 1e6:.1f} MB",
             "| system | rank | peak anon RSS, load to end of setup (x W) | load phase (x W) | setup phase (x W) | "
             "at end of setup (x W) | seconds | bytes read (x its share) | read <= file share + largest tensor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for system, rows in results.items():
        for r in rows:
            r["within_share_plus_one_tensor"] = (None if r["bytes_read"] is None
                                                 else r["bytes_read"] <= file_share + largest)
            read = "-" if r["bytes_read"] is None else f"{r['bytes_read'] / r['share']:.3f}"
            ok = {None: "-", True: "yes", False: "NO"}[r["within_share_plus_one_tensor"]]
            lines.append(f"| {system} | {r['rank']} | {r['peak_anon'] / w:.2f} | {r['load_peak_anon'] / w:.2f} | "
                         f"{r['setup_peak_anon'] / w:.2f} | {r['after_anon'] / w:.2f} | {r['seconds']:.1f} | "
                         f"{read} | {ok} |")
    lines += [f"{system}: {why}" for system, why in skipped.items()]
    lines.append("load average (1 min) at start and after each system: "
                 + ", ".join(f"{x[0]:.1f}" for x in load))
    print("\n".join(lines))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        config = {k: v for k, v in vars(args).items() if k not in ("worker", "dir", "report", "out")}
        json.dump(dict(config=config, params=params, w_bytes=w, file_bytes=sum(tensors), largest_tensor_bytes=largest,
                       results=results, skipped=skipped, loadavg=load), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
