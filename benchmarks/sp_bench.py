"""Sequence parallelism on gloo ranks: per-rank peak anonymous memory and step time, sp 1, 2 (and 4).

The model of issue 40's report: a Llama-style ``LlamaForCausalLM`` (random weights; default 2
layers, hidden 64, 4 heads, 2 kv heads, vocab 32,000, so the full-vocabulary logits and the
loss's copies of them are most of the activations), ``zero3`` with
``param_persistence_threshold=0``, fp32, AdamW. For each sequence length and each SP size,
each rank trains one warm-up step and then ``--steps`` steps of one sample of that length: at sp 1 each rank its own
whole sample (plain data parallelism), at sp 2 both ranks one sample, half each
(``zs.shard_sequence`` / ``zs.sequence_parallel_loss``). Reported per rank: the peak
anonymous resident memory (from the kernel's high-water mark ``VmHWM``, See [Note: the peak from the
high-water mark]; ``--rss-sampler``: ``RssAnon`` polled every 5 ms, as before 2026-12-07) above the
baseline after the warm-up step (the model set up and its optimizer state made: what is left
is activations, gradients in flight and the step's temporaries), and the mean step time of
the measured steps (wall time, and the training thread's own time on a CPU, which other work on a
shared machine does not lengthen). glibc is made to return freed blocks so that RSS follows what is held.

[Note: activation memory beside the whole peak]
The peak above the baseline holds the step's activations and, beside them, the model states'
transients: at stage 3 a module's gathered parameters and its whole gradient before the
reduce-scatter (the 32,000-token head's: 2 x 7.8 MiB here), which are the same at every sequence
length and every SP degree. Issue 40's memory target ("at sp=N a rank's activation memory is at most
1/N of sp=1's plus 10%") is about the activations, so after each of our runs the same set-up model
trains ``--floor-length`` tokens (default 64) and the table gives, beside the whole peak, the peak
minus that floor's peak: what the sequence's length adds. Both figures are reported and the ratios
carry both (``memory_over_sp1``: whole peaks; ``activation_over_sp1``: above the floor); the floor
runs after the measured steps, so those are unchanged. DeepSpeed's rows have no floor.

With ``--tiled on`` (or ``off on``) the loss is the tiled loss (``ZeroConfig(tiled_loss=True)``: the
model's own loss from ``model(..., labels=...)`` at sp 1 and ``model(..., shift_labels=...)`` at sp 2,
no logits made). Beside each measured peak the table gives ``estimate_activations(...,
sequence_parallel_size=sp, tiled_loss=...).peak_without_checkpointing`` (with ``--checkpointing``,
``peak_with_checkpointing`` plus the offloaded inputs' ``host_bytes``); that estimate counts the
logits a loop holds through backward, which this loop does not (it keeps only the loss), so untiled
it is one copy of the logits above the measure. ``--max-estimate-gib G`` skips a configuration whose
estimate is above G GiB per rank (a shared machine).

``--longest-within-gib G`` replaces ``--lengths``: for each SP size and loss, the longest sequence whose
estimate per rank is at most G GiB, found by doubling from 1,024 tokens and then bisecting to 1,024
tokens (the search is printed), and then run once to confirm it (``--run-up-to L``: not above L tokens,
where a step would take too long; the search is still reported).

``--world N`` runs N ranks (each SP size divides N). ``--dp-same-tokens`` runs, before each sp N > 1,
plain data parallelism (sp 1) at length/N: the same tokens per rank, so the step-time ratio of issue
40's target (SP at most 1.3x data parallelism at the same tokens per rank) is measured side by side.
``--tiled-mlp`` and ``--checkpointing`` (one checkpoint per layer, ``gradient_checkpointing_enable``;
with it ``activation_offload``, a placement no-op on the CPU, where the layer inputs are in host memory
already) are the activation tools for the longest sequence. ``--deepspeed`` adds, after our rows,
DeepSpeed's ALST at each sp > 1 on the same model, length and loss (benchmarks/sp_bench_deepspeed.py).

Usage (from the repository root)::

    python benchmarks/sp_bench.py                          # lengths 1024 2048 4096
    python benchmarks/sp_bench.py --lengths 512 1024 --steps 3
    python benchmarks/sp_bench.py --lengths 16384 --tiled off on --steps 1 --max-estimate-gib 6
    python benchmarks/sp_bench.py --world 4 --sp 1 2 4 --lengths 4096 --tiled off on --dp-same-tokens --deepspeed

It re-launches itself with ``torch.distributed.run`` on ``--world`` ranks; rank 0 prints the table and
writes ``benchmarks/out/sp_bench.json`` (with the load average before and after, and beside each row).
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
    p.add_argument("--world", type=int, default=2, help="gloo ranks")
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2], help="SP sizes (each divides --world)")
    p.add_argument("--tiled", nargs="+", choices=("off", "on"), default=["off"], help="the tiled loss: off, on")
    p.add_argument("--tiled-mlp", action="store_true", help="ZeroConfig(tiled_mlp=True)")
    p.add_argument("--checkpointing", action="store_true",
                   help="one checkpoint per layer, with activation_offload (a no-op placement on the CPU)")
    p.add_argument("--dp-same-tokens", action="store_true",
                   help="before each sp N > 1, sp 1 (data parallelism) at length/N: the same tokens per rank")
    p.add_argument("--deepspeed", action="store_true", help="DeepSpeed's ALST at each sp > 1 after our rows")
    p.add_argument("--longest-within-gib", type=float, default=None,
                   help="instead of --lengths: per SP size and loss, the longest sequence whose estimate per rank "
                        "is at most this (doubling from 1024, then bisecting to 1024 tokens), then run it")
    p.add_argument("--run-up-to", type=int, default=None,
                   help="with --longest-within-gib: report but do not run a longest sequence above this")
    p.add_argument("--master-port", type=int, default=29623)
    p.add_argument("--max-estimate-gib", type=float, default=None,
                   help="skip a configuration whose activation estimate per rank is above this")
    p.add_argument("--floor-length", type=int, default=64,
                   help="after each of our runs, the same model at this many tokens: its peak is the model states' "
                        "transients, and the run's peak minus it the activations (0: not run)")
    p.add_argument("--rss-sampler", action="store_true",
                   help="the peak by a thread polling RssAnon every 5 ms (the measure before 2026-12-07) instead of "
                        "the kernel's high-water mark")
    p.add_argument("--out", default=os.path.join(HERE, "out", "sp_bench.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _status(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status in bytes."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in keys}


def _anon() -> int:
    return _status("RssAnon")["RssAnon"]


class PeakMeter:
    """The peak anonymous RSS from the kernel's high-water mark, with no thread beside the step.

    [Note: the peak from the high-water mark]
    Writing 5 to /proc/self/clear_refs sets ``VmHWM`` to the resident set now; the kernel raises it
    before every unmap (each freed block, with the mallopt of :func:`worker`), so read afterwards it
    is the peak of the resident set in between, however briefly it was held (to the slack of the
    kernel's per-CPU counters, under a MiB). ``VmHWM`` counts file pages too: the peak of the
    anonymous part is at most ``VmHWM`` minus the file and shared pages at the start
    (``file_growth`` says by how much that can overstate it: the file pages mapped in between, a
    few MiB of code at most). The 5 ms polling thread this replaced
    (:class:`PeakSampler`, ``--rss-sampler``) missed peaks shorter than its period and took the
    interpreter's lock 200 times a second from the step it measured."""

    def __init__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._file = self._file_pages()

    @staticmethod
    def _file_pages() -> int:
        got = _status("RssFile", "RssShmem")
        return got["RssFile"] + got["RssShmem"]

    def stop(self) -> int:
        self.file_growth = self._file_pages() - self._file
        return _status("VmHWM")["VmHWM"] - self._file


class PeakSampler:
    """The highest RssAnon seen by a thread polling every 5 ms (``--rss-sampler``: the measure before
    :class:`PeakMeter`, kept to compare the two)."""

    def __init__(self):
        self.peak = _anon()
        self.file_growth = 0
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
    """The activation estimate per rank of this configuration. On the CPU activation offload's
    host bytes are in the same memory as the rest, so they are added back."""
    from zero_strategy.estimate import estimate_activations

    est = estimate_activations(_llama_config(args), 1, length, "fp32", "sdpa", tiled_loss=tiled,
                               tiled_mlp=args.tiled_mlp, sequence_parallel_size=sp,
                               activation_offload=args.checkpointing)
    return est.peak(args.checkpointing) + est.host_bytes


def one_run(args, length: int, sp: int, tiled: bool = False) -> dict:
    import gc

    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import zero_strategy as zs

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(args))
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                          {"preset": args.preset, "param_persistence_threshold": 0, "sequence_parallel_size": sp,
                           "tiled_loss": tiled, "tiled_mlp": args.tiled_mlp,
                           "activation_offload": args.checkpointing})
    g = torch.Generator().manual_seed(rank // sp)  # the ranks of an SP group read the same sample
    batches = [torch.randint(0, args.vocab, (1, length), generator=g) for _ in range(args.steps + 1)]

    def step(ids):
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
        return loss.item()

    row = measure(step, batches, args.rss_sampler)
    if args.floor_length:  # See [Note: activation memory beside the whole peak]
        tiny = min(args.floor_length, length)
        floor = measure(step, [torch.randint(0, args.vocab, (1, tiny), generator=g) for _ in range(args.steps + 1)],
                        args.rss_sampler)
        row.update(floor_length=tiny, floor_peak_anon_MiB=floor["peak_anon_MiB"],
                   activation_MiB=row["peak_anon_MiB"] - floor["peak_anon_MiB"])
    zs.teardown(model, keep_weights=False)
    del model, opt
    gc.collect()
    return {"system": "zero_strategy", "rank": rank, "length": length, "sp": sp, "tiled": tiled,
            "tokens_per_rank": length // sp, **row, "estimate_MiB": estimate_bytes(args, length, sp, tiled) / MiB}


def _on_cpu() -> tuple[int, int]:
    """This thread's (time on a CPU, time waiting in a run queue) so far, in ns (schedstat)."""
    with open("/proc/thread-self/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu), int(waiting)


def measure(step, batches, sampler: bool = False) -> dict:
    """Run ``step`` on each batch; the first is the warm-up (it makes the optimizer state). The
    peak anonymous RSS above the baseline after it (the kernel's high-water mark, or with ``sampler``
    a thread polling every 5 ms; See [Note: the peak from the high-water mark]), the mean time of
    the others, the load average.

    Beside the wall time, the training thread's own time on a CPU and its wait in the run queue
    (``step_cpu_s``, ``step_runq_s``): on a shared machine the wait for a CPU is most of the
    difference between two runs' wall times, and it says nothing of the code measured."""
    import gc

    import torch.distributed as dist

    times, cpu, runq, losses = [], [], [], []
    for index, ids in enumerate(batches):
        if index == 1:  # after a first step has made the optimizer state: what follows is activations
            gc.collect()
            dist.barrier()
            base = _anon()
            meter = PeakSampler() if sampler else PeakMeter()
        c0, q0 = _on_cpu()
        t0 = time.perf_counter()
        losses.append(step(ids))
        times.append(time.perf_counter() - t0)
        c1, q1 = _on_cpu()
        cpu.append((c1 - c0) / 1e9)
        runq.append((q1 - q0) / 1e9)
    peak = meter.stop() - base
    n = len(batches) - 1
    return {"peak_anon_MiB": peak / MiB, "step_s": sum(times[1:]) / n, "step_cpu_s": sum(cpu[1:]) / n,
            "step_runq_s": sum(runq[1:]) / n, "losses": losses, "load1": os.getloadavg()[0],
            "peak_by": "sampler" if sampler else "high-water mark", "file_growth_MiB": meter.file_growth / MiB}


def _write(args, rows: list, skipped: list, ratios: dict, load_before, searches: list = ()) -> None:
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "rows": rows,
                   "skipped": skipped, "ratios": ratios, "searches": list(searches), "loadavg_before": load_before,
                   "loadavg_after": os.getloadavg()}, f, indent=1)


def longest_within(args, sp: int, tiled: bool, budget: float) -> tuple[int | None, list]:
    """The longest sequence (a multiple of 1024 tokens) whose estimate per rank is at most ``budget``
    bytes, and the (length, estimate MiB) pairs the search tried: doubling, then bisection."""
    tried = []

    def fits(length: int) -> bool:
        est = estimate_bytes(args, length, sp, tiled)
        tried.append((length, est / MiB))
        return est <= budget

    step = 1024
    lo = step
    if not fits(lo):
        return None, tried
    hi = 2 * lo
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, tried


def plan(args) -> list[tuple[int, int, bool]]:
    """(length, sp, tiled) in the order run: per length and loss, sp 1, then for each sp N > 1 the
    data-parallel run at length/N (with ``--dp-same-tokens``) just before it, so the pair is close in time."""
    out = []
    for length in args.lengths:
        for tiled in (mode == "on" for mode in args.tiled):
            for sp in args.sp:
                if sp > 1 and args.dp_same_tokens and (length // sp, 1, tiled) not in out:
                    out.append((length // sp, 1, tiled))
                if (length, sp, tiled) not in out:
                    out.append((length, sp, tiled))
    return out


def ratios_of(rows: list) -> dict:
    """Issue 40's two targets per (length, loss, sp N > 1), from the worst rank of each configuration:
    memory sp N / sp 1 at the same length (target at most 1/N + 0.1; the whole peak, and with
    ``--floor-length`` the activations alone, See [Note: activation memory beside the whole peak])
    and step time sp N at length L
    against data parallelism (sp 1) at L/N, the same tokens per rank (target at most 1.3). For
    DeepSpeed's rows: memory and time over ours in the same configuration."""
    worst = {}
    for r in rows:
        key = (r["system"], r["length"], r["sp"], r["tiled"])
        w = worst.setdefault(key, {"peak_anon_MiB": 0.0, "step_s": 0.0})
        w["peak_anon_MiB"] = max(w["peak_anon_MiB"], r["peak_anon_MiB"])
        w["step_s"] = max(w["step_s"], r["step_s"])
        if "step_cpu_s" in r:
            w["step_cpu_s"] = max(w.get("step_cpu_s", 0.0), r["step_cpu_s"])
        if "activation_MiB" in r:
            w["activation_MiB"] = max(w.get("activation_MiB", 0.0), r["activation_MiB"])
    out = {}
    for (system, length, sp, tiled), row in worst.items():
        if sp == 1:
            continue
        entry = {}
        if system == "deepspeed":
            ours = worst.get(("zero_strategy", length, sp, tiled))
            if ours:
                entry["memory_over_ours"] = row["peak_anon_MiB"] / ours["peak_anon_MiB"]
                entry["time_over_ours"] = row["step_s"] / ours["step_s"]
                if "step_cpu_s" in row and "step_cpu_s" in ours:
                    entry["cpu_over_ours"] = row["step_cpu_s"] / ours["step_cpu_s"]
        one = worst.get((system, length, 1, tiled)) if system == "zero_strategy" else None
        if one:
            entry["memory_over_sp1"] = row["peak_anon_MiB"] / one["peak_anon_MiB"]
            entry["memory_target"] = 1 / sp + 0.1
            entry["memory_met"] = entry["memory_over_sp1"] <= entry["memory_target"]
            if "activation_MiB" in row and "activation_MiB" in one:
                entry["activation_over_sp1"] = row["activation_MiB"] / one["activation_MiB"]
                entry["activation_met"] = entry["activation_over_sp1"] <= entry["memory_target"]
        dp = worst.get((system, length // sp, 1, tiled)) if system == "zero_strategy" else None
        if dp:
            entry["time_over_dp_same_tokens_per_rank"] = row["step_s"] / dp["step_s"]
            entry["time_met"] = entry["time_over_dp_same_tokens_per_rank"] <= 1.3
        out[f"{system} {length}{' tiled' if tiled else ''} sp {sp}"] = entry
    return out


def _print_row(every: list) -> None:
    worst = max(every, key=lambda r: r["peak_anon_MiB"])
    r = every[0]
    activation = ""
    if "activation_MiB" in r:
        activation = (f"; above the {r['floor_length']}-token floor "
                      f"{max(x['activation_MiB'] for x in every):8.1f}")
    print(f"{r['system']:13} seq {r['length']:6d}  sp {r['sp']}  tiled {r['tiled']!s:5}  tokens/rank "
          f"{r['length'] // r['sp']:6d}  peak anon RSS above setup {worst['peak_anon_MiB']:8.1f} MiB (worst rank; "
          f"estimate {worst['estimate_MiB']:8.1f}{activation})  step {max(x['step_s'] for x in every):6.2f} s (on a CPU "
          f"{max(x.get('step_cpu_s', 0.0) for x in every):5.2f} s)  "
          f"loss {r['losses'][0]:.6f}  load {r['load1']:.2f}", flush=True)


def worker(args) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed blocks go back to the OS
    libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    load_before = os.getloadavg()
    rows, skipped, searches = [], [], []
    if args.longest_within_gib is not None:
        runs = []
        for tiled in (mode == "on" for mode in args.tiled):
            for sp in args.sp:
                length, tried = longest_within(args, sp, tiled, args.longest_within_gib * 2**30)
                run = length is not None and (args.run_up_to is None or length <= args.run_up_to)
                searches.append({"sp": sp, "tiled": tiled, "longest": length, "tried": tried, "run": run})
                if dist.get_rank() == 0:
                    print(f"longest within {args.longest_within_gib} GiB: sp {sp} tiled {tiled}: {length} tokens "
                          f"({'run' if run else 'not run: above --run-up-to'}); tried "
                          + ", ".join(f"{L}: {m:.0f} MiB" for L, m in tried), flush=True)
                if run:
                    runs.append(("zero_strategy", length, sp, tiled))
        args.lengths = [length for _, length, _, _ in runs] or args.lengths  # the model's positions
    else:
        runs = [("zero_strategy", *run) for run in plan(args)]
    if args.deepspeed:  # last: registering ALST replaces transformers' sdpa function in this process
        runs += [("deepspeed", length, sp, tiled) for _, length, sp, tiled in runs if sp > 1]
    for system, length, sp, tiled in runs:
        estimate = estimate_bytes(args, length, sp, tiled)
        if args.max_estimate_gib is not None and estimate > args.max_estimate_gib * 2**30:
            skipped.append({"system": system, "length": length, "sp": sp, "tiled": tiled,
                            "estimate_MiB": estimate / MiB})
            if dist.get_rank() == 0:
                print(f"{system:13} seq {length:6d}  sp {sp}  tiled {tiled!s:5}  skipped: estimate "
                      f"{estimate / 2**30:.2f} GiB per rank > {args.max_estimate_gib} GiB", flush=True)
            continue
        if system == "deepspeed":
            from sp_bench_deepspeed import deepspeed_run

            mine = deepspeed_run(args, length, sp, tiled)
        else:
            mine = one_run(args, length, sp, tiled)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        rows.extend(every)
        if dist.get_rank() == 0:
            _write(args, rows, skipped, {}, load_before, searches)  # a run cut short keeps what it measured
            _print_row(every)
    if dist.get_rank() == 0:
        ratios = ratios_of(rows)
        print(json.dumps(ratios, indent=1))
        _write(args, rows, skipped, ratios, load_before, searches)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> int:
    a = parse_args()
    bad = [sp for sp in a.sp if a.world % sp]
    if bad:
        raise SystemExit(f"sp_bench: --sp {bad} does not divide --world {a.world}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.world),
           "--master-port", str(a.master_port), os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    return subprocess.call(cmd)


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    else:
        sys.exit(main())
