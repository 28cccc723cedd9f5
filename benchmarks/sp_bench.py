"""Sequence parallelism on 2 gloo ranks: per-rank peak anonymous memory and step time, sp 1 vs sp 2.

The model of issue 40's report: a Llama-style ``LlamaForCausalLM`` (random weights; default 2
layers, hidden 64, 4 heads, 2 kv heads, vocab 32,000, so the full-vocabulary logits and the
loss's copies of them are most of the activations), ``zero3`` with
``param_persistence_threshold=0``, fp32, AdamW. For each sequence length and each SP size,
each rank trains one warm-up step and then ``--steps`` steps of one sample of that length: at sp 1 each rank its own
whole sample (plain data parallelism), at sp 2 both ranks one sample, half each
(``zs.shard_sequence`` / ``zs.sequence_parallel_loss``). Reported per rank: the peak
anonymous resident memory (``RssAnon`` of /proc/self/status, sampled every 5 ms) above the
baseline after the warm-up step (the model set up and its optimizer state made: what is left
is activations, gradients in flight and the step's temporaries), and the mean step time of
the measured steps. glibc is made to return freed blocks so that RSS follows what is held.

With ``--tiled on`` (or ``off on``) the loss is the tiled loss (``ZeroConfig(tiled_loss=True)``: the
model's own loss from ``model(..., labels=...)`` at sp 1 and ``model(..., shift_labels=...)`` at sp 2,
no logits made). Beside each measured peak the table gives ``estimate_activations(...,
sequence_parallel_size=sp, tiled_loss=...).peak_without_checkpointing``; that estimate counts the
logits a loop holds through backward, which this loop does not (it keeps only the loss), so untiled
it is one copy of the logits above the measure. ``--max-estimate-gib G`` skips a configuration whose
estimate is above G GiB per rank (a shared machine).

Usage (from the repository root)::

    python benchmarks/sp_bench.py                          # lengths 1024 2048 4096
    python benchmarks/sp_bench.py --lengths 512 1024 --steps 3
    python benchmarks/sp_bench.py --lengths 16384 --tiled off on --steps 1 --max-estimate-gib 6

It re-launches itself with ``torch.distributed.run`` on 2 ranks; rank 0 prints the table and
writes ``benchmarks/out/sp_bench.json`` (with the load average before and after).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--preset", default="zero3")
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2], help="SP sizes (each divides 2)")
    p.add_argument("--tiled", nargs="+", choices=("off", "on"), default=["off"], help="the tiled loss: off, on")
    p.add_argument("--max-estimate-gib", type=float, default=None,
                   help="skip a configuration whose activation estimate per rank is above this")
    p.add_argument("--out", default=os.path.join(HERE, "out", "sp_bench.json"))
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


def _llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                       num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=max(args.lengths), attn_implementation="sdpa")


def estimate_bytes(args, length: int, sp: int, tiled: bool) -> int:
    from zero_strategy.estimate import estimate_activations

    return estimate_activations(_llama_config(args), 1, length, "fp32", "sdpa", tiled_loss=tiled,
                                sequence_parallel_size=sp).peak_without_checkpointing


def one_run(args, length: int, sp: int, tiled: bool = False) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import zero_strategy as zs

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(args))
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                          {"preset": args.preset, "param_persistence_threshold": 0, "sequence_parallel_size": sp,
                           "tiled_loss": tiled})
    g = torch.Generator().manual_seed(rank // sp)  # the ranks of an SP group read the same sample
    batches = [torch.randint(0, args.vocab, (1, length), generator=g) for _ in range(args.steps + 1)]
    times = []
    for step, ids in enumerate(batches):
        if step == 1:  # after a first step has made the optimizer state: what follows is activations
            gc.collect()
            dist.barrier()
            base = _anon()
            sampler = PeakSampler()
        t0 = time.perf_counter()
        if sp == 1:
            loss = model(input_ids=ids, labels=ids).loss
        elif tiled:  # the shard's loss from the model itself, its logits never made
            shard = zs.shard_sequence({"input_ids": ids, "labels": ids}, model)
            loss = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                         shift_labels=shard["shift_labels"]).loss
            loss = zs.sequence_parallel_loss(loss, shard["shift_labels"], model)
        else:
            shard = zs.shard_sequence({"input_ids": ids, "labels": ids}, model)
            out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
            loss = model.loss_function(logits=out.logits, labels=None, shift_labels=shard["shift_labels"],
                                       vocab_size=args.vocab)
            loss = zs.sequence_parallel_loss(loss, shard["shift_labels"], model)
            del out
        loss.backward()
        opt.step()
        opt.zero_grad()
        del loss
        times.append(time.perf_counter() - t0)
    peak = sampler.stop() - base
    zs.teardown(model, keep_weights=False)
    del model, opt
    gc.collect()
    timed = times[1:]
    return {"rank": rank, "length": length, "sp": sp, "tiled": tiled, "tokens_per_rank": length // sp,
            "peak_anon_MiB": peak / MiB, "step_s": sum(timed) / len(timed),
            "estimate_MiB": estimate_bytes(args, length, sp, tiled) / MiB}


def _write(args, rows: list, skipped: list, ratios: dict, load_before) -> None:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "rows": rows,
                   "skipped": skipped, "ratios": ratios, "loadavg_before": load_before,
                   "loadavg_after": os.getloadavg()}, f, indent=1)


def worker(args) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed blocks go back to the OS
    libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    load_before = os.getloadavg()
    rows, skipped = [], []
    for length in args.lengths:
        for tiled in (mode == "on" for mode in args.tiled):
            for sp in args.sp:
                estimate = estimate_bytes(args, length, sp, tiled)
                if args.max_estimate_gib is not None and estimate > args.max_estimate_gib * 2**30:
                    skipped.append({"length": length, "sp": sp, "tiled": tiled, "estimate_MiB": estimate / MiB})
                    if dist.get_rank() == 0:
                        print(f"seq {length:6d}  sp {sp}  tiled {tiled!s:5}  skipped: estimate "
                              f"{estimate / 2**30:.2f} GiB per rank > {args.max_estimate_gib} GiB", flush=True)
                    continue
                mine = one_run(args, length, sp, tiled)
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                rows.extend(every)
                if dist.get_rank() == 0:
                    _write(args, rows, skipped, {}, load_before)  # a run cut short keeps what it measured
                    worst = max(every, key=lambda r: r["peak_anon_MiB"])
                    print(f"seq {length:6d}  sp {sp}  tiled {tiled!s:5}  tokens/rank {length // sp:6d}  peak anon RSS "
                          f"above setup {worst['peak_anon_MiB']:8.1f} MiB (worst rank; estimate "
                          f"{worst['estimate_MiB']:8.1f})  step {max(r['step_s'] for r in every):6.2f} s", flush=True)
    if dist.get_rank() == 0:
        by = {(r["length"], r["sp"], r["tiled"]): r for r in rows if r["rank"] == 0}
        ratios = {}
        for (L, sp, tiled), row in by.items():
            key = f"{L}{' tiled' if tiled else ''}"
            if sp == 2 and (L, 1, tiled) in by:
                ratios.setdefault(key, {})["memory_sp2_over_sp1"] = row["peak_anon_MiB"] / by[(L, 1, tiled)]["peak_anon_MiB"]
            if sp == 2 and (L // 2, 1, tiled) in by:  # the same tokens per rank: sp 2 at L against sp 1 at L/2
                ratios.setdefault(key, {})["time_sp2_over_sp1_same_tokens_per_rank"] = \
                    row["step_s"] / by[(L // 2, 1, tiled)]["step_s"]
        print(json.dumps(ratios, indent=1))
        _write(args, rows, skipped, ratios, load_before)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29623",
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    return subprocess.call(cmd)


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    else:
        sys.exit(main())
