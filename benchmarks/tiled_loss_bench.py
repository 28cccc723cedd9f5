"""What the tiled loss saves: per-process peak anonymous memory and step time, tiled and untiled.

The model of issue 40: a 2-layer Llama (hidden 32) with a 32,000-token vocabulary, one sequence
of ``--seq`` tokens per rank, ``ZeroConfig(stage=3, param_persistence_threshold=0)`` with and
without ``tiled_loss``, in fp32 on the CPU, trained by ``outputs = model(input_ids=ids,
labels=ids); outputs.loss.backward(); optimizer.step()``. Each configuration runs in fresh
processes (one per rank, gloo), so no run inherits another's freed memory.

What is measured, per rank, in the step after one warm-up step (the optimizer state and the
gradient buffers exist by then): the peak of the process's anonymous RSS (RssAnon of
/proc/self/status, sampled every millisecond by a thread while the step runs; glibc is made to
unmap freed blocks, as tests/_rss.py does, so RSS follows what is held) above its value before
the step, and the step's wall time (median of ``--steps`` steps). The full logits of one
sequence, seq x vocab x 4 bytes, are printed beside them: the untiled step holds several copies,
the tiled one none.

    python benchmarks/tiled_loss_bench.py                       # 4K tokens, 1 rank, ~1 minute on 2 cores
    python benchmarks/tiled_loss_bench.py --seq 4096 8192 --ranks 1 2

Prints a Markdown table with the load average and writes benchmarks/out/tiled_loss.json.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
MiB = 1 << 20


# ------------------------------------------------------------------------- one rank
def _anon_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class PeakSampler:
    """The highest RssAnon seen between ``start()`` and ``stop()`` (a thread reading it every ms:
    matmuls release the GIL, so it keeps sampling while the step computes)."""

    def __init__(self):
        self.peak, self._running, self._thread = 0, False, None

    def _loop(self):
        while self._running:
            self.peak = max(self.peak, _anon_rss())
            time.sleep(0.001)

    def start(self):
        self.peak, self._running = _anon_rss(), True
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._running = False
        self._thread.join()
        return max(self.peak, _anon_rss())


def rank_main(args) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))  # See tests/_rss.py return_freed_memory_to_the_os
    libc.mallopt(-3, 1 << 16)
    libc.mallopt(-1, 1 << 16)
    sys.path.insert(0, str(SRC))
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero_strategy as zs

    torch.set_num_threads(args.threads)
    seq = args.seq[0]
    if args.world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if args.world > 1 else 0
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    zero = {"stage": 3, "param_persistence_threshold": 0, **({"tiled_loss": True} if args.tiled else {})}
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), zero)
    ids = torch.randint(0, args.vocab, (1, seq), generator=torch.Generator().manual_seed(rank))

    def step():
        outputs = model(input_ids=ids, labels=ids)
        outputs.loss.backward()
        opt.step()
        opt.zero_grad()
        return outputs.loss.item()

    step()  # warm-up: optimizer state, gradient buffers
    peaks, times, losses = [], [], []
    for _ in range(args.steps):
        sampler = PeakSampler()
        before = _anon_rss()
        sampler.start()
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
        peaks.append(sampler.stop() - before)
    report = {"rank": rank, "peak_anon_growth": max(peaks), "step_s": statistics.median(times), "losses": losses}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    if args.world > 1:
        dist.destroy_process_group()
    os._exit(0)


# ------------------------------------------------------------------------- the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(seq: int, world: int, tiled: bool, vocab: int, steps: int, threads: int, out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.json"):
        f.unlink()
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, __file__, "--rank-main", "--seq", str(seq), "--world", str(world), "--vocab",
               str(vocab), "--steps", str(steps), "--threads", str(threads), "--out", str(out)]
        procs.append(subprocess.Popen(cmd + (["--tiled"] if tiled else []), env=env))
    for p in procs:
        p.wait(timeout=900)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=str(HERE / "out" / "tiled_loss.json"))
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    rows = []
    scratch = Path(args.json).parent / "tiled_loss_ranks"
    for seq in args.seq:
        for world in args.ranks:
            for tiled in (False, True):
                load = os.getloadavg()[0]
                reports = run_config(seq, world, tiled, args.vocab, args.steps, args.threads, scratch)
                rows.append({"seq": seq, "ranks": world, "tiled": tiled, "load_average": round(load, 2),
                             "logits_bytes": seq * args.vocab * 4,
                             "peak_anon_growth_per_rank": max(r["peak_anon_growth"] for r in reports),
                             "step_s": max(r["step_s"] for r in reports),
                             "loss": reports[0]["losses"][-1]})
                print(json.dumps(rows[-1]), flush=True)
    print("\n| tokens/rank | ranks | loss | peak anon. RSS growth per rank | step time | full logits (1 copy) | load avg |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['seq']:,} | {r['ranks']} | {'tiled' if r['tiled'] else 'untiled'} | "
              f"{r['peak_anon_growth_per_rank'] / MiB:,.0f} MiB | {r['step_s']:.2f} s | "
              f"{r['logits_bytes'] / MiB:,.0f} MiB | {r['load_average']} |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"vocab": args.vocab, "hidden": 32, "layers": 2, "preset": "zero3",
                                           "threads_per_rank": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
