"""Peak anonymous memory of an NVMe-offloaded training step: what the staging buffers cost.

A Llama-style model (``transformers.LlamaForCausalLM``, random weights; default 8 layers,
hidden 512, vocab 32000: 58M parameters, most of them in the embeddings and the LM head,
the root unit's group) with ``zero3_offload_nvme`` in bf16 on 2 gloo ranks. Each rank
samples its anonymous resident memory (``RssAnon`` of /proc/self/status, every 5 ms) and
reports the peak above its baseline after setup (the model built, sharded and its
unsharded copy freed) through ``--steps`` AdamW steps, in MiB and in multiples of W (the
fp32 weights, 4 bytes per parameter), beside what ``memory_report`` counts as staging.
Mapped files and the page cache are left out; glibc is made to return freed blocks so
that RSS follows what is held.

Usage (from the repository root)::

    python benchmarks/nvme_staging_memory.py                     # this checkout
    python benchmarks/nvme_staging_memory.py --buffer-size 16777216

It re-launches itself with ``torch.distributed.run`` on 2 ranks; rank 0 prints one line
per rank and writes ``benchmarks/out/nvme_staging_memory.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="sequence length of the one sample per rank")
    p.add_argument("--buffer-size", type=int, default=None, help="NVMeOffload.buffer_size (default: its own)")
    p.add_argument("--out", default=os.path.join(HERE, "out", "nvme_staging_memory.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class PeakSampler:
    """The highest RssAnon seen by a thread polling every 5 ms."""

    def __init__(self):
        self.peak = _anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _anon())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _anon())


def worker(args) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed blocks go back to the OS
    libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero_strategy as zs

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875),
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=256, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    W = 4 * params
    nvme = {"device": "nvme", "path": os.path.join(args.swap, f"r{rank}")}
    if args.buffer_size:
        nvme["buffer_size"] = args.buffer_size
    config = zs.ZeroConfig.preset("zero3_offload_nvme", precision="bf16", offload_optimizer=nvme, offload_params=nvme)
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config,
                          param_init_fn=model._init_weights)
    dist.barrier()
    base = _anon()
    sampler = PeakSampler()
    g = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - t0
    peak = sampler.stop() - base
    report = zs.memory_report(model)
    res = {"rank": rank, "params": params, "W_MiB": W / MiB, "train_peak_anon_MiB": peak / MiB,
           "train_peak_W": peak / W, "seconds": seconds,
           "staging_MiB": report.by_category["staging"] / MiB,
           "peak_working_set_MiB": {k: v / MiB for k, v in getattr(report, "peak_working_set", {}).items()},
           "buffer_size": config.offload_optimizer.buffer_size, "buffer_count": config.offload_optimizer.buffer_count}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, res)
    if rank == 0:
        for r in out:
            print(f"rank {r['rank']}: {r['params'] / 1e6:.1f}M params, W = {r['W_MiB']:.0f} MiB; train peak anon RSS "
                  f"above baseline {r['train_peak_anon_MiB']:.0f} MiB = {r['train_peak_W']:.2f} W; staging "
                  f"(memory_report) {r['staging_MiB']:.1f} MiB; peak working set {r['peak_working_set_MiB']}; "
                  f"{r['seconds']:.1f} s for {args.steps} steps")
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "ranks": out, "loadavg": os.getloadavg()}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="zs_staging_") as swap:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29617",
               os.path.abspath(__file__), "--worker", *sys.argv[1:]]
        env = {**os.environ, "ZS_BENCH_SWAP": swap}
        return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        a.swap = os.environ["ZS_BENCH_SWAP"]
        worker(a)
    else:
        sys.exit(main())
