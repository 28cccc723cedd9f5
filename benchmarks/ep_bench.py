"""Expert parallelism beside the stage-3 gather path, on 2 gloo ranks, the same model in the same run.

A Mixtral (``MixtralForCausalLM`` from its config, random weights; default 2 layers, hidden 256,
8 experts of intermediate 512, top 2, vocabulary 1,000: the experts are most of the weights),
``zero3`` with ``param_persistence_threshold=0``, fp32, AdamW, each rank its own batch
(``--batch`` sequences of ``--seq`` tokens). Two set-ups of the same initial model:

* ``gather``: plain stage 3, every rank gathers every expert of a layer before it runs;
* ``ep``: ``expert_parallel_size=2``, each rank holds its 4 experts per layer whole and tokens
  travel to their experts and back by all-to-all.

They train in alternating rounds (``--rounds`` of ``--steps`` steps each, default one step, after
one warm-up step each), so the machine's load falls on both alike; reported per set-up: the median step time,
the expert bytes a rank holds at rest, and what it sends per step: the engine's gathers and
reduce-scatters (its own count) and, for ``ep``, the all-to-alls (rows that leave the rank,
times hidden x 4 bytes, twice in forward and twice in backward).

Usage (from the repository root)::

    python benchmarks/ep_bench.py
    python benchmarks/ep_bench.py --hidden 512 --experts 8 --rounds 4

It re-launches itself with ``torch.distributed.run`` on 2 ranks; rank 0 prints the table and
writes ``benchmarks/ep_bench.json`` (with the load average before and after).
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
MiB = 2**20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--out", default=os.path.join(HERE, "ep_bench.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args, ep: bool):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    import zero_strategy as zs
    from zero_strategy._model.expert_parallel import ExpertParallelExperts

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=args.seq)
    model = MixtralForCausalLM(cfg)
    whole = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    config = {"preset": "zero3", "param_persistence_threshold": 0}
    if ep:
        config["expert_parallel_size"] = 2
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config)
    if ep:
        held = sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, ExpertParallelExperts)
                   for p in m.parameters())
    else:  # stage 3: this rank's shard of the experts' flat groups (its 1/N, gathered whole for each use)
        held = whole // 2
    return model, opt, whole, held


def sent_rows_counter(model):
    """Hooks counting the (token, expert) rows this rank sends to the other rank's experts."""
    from zero_strategy._model.expert_parallel import ExpertParallelExperts
    count = [0]

    def hook(m, args):
        idx = args[1]
        count[0] += int(((idx < m.first) | (idx >= m.first + m.num_local)).sum())
    for m in model.modules():
        if isinstance(m, ExpertParallelExperts):
            m.register_forward_pre_hook(hook)
    return count


def run_steps(model, opt, batches) -> list[float]:
    times = []
    for ids in batches:
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zero_strategy as zs

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    load_before = os.getloadavg()
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data: routing differs by rank
    batch = lambda: torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)  # noqa: E731
    setups = {name: build(args, name == "ep") for name in ("gather", "ep")}
    rows = sent_rows_counter(setups["ep"][0])
    times: dict[str, list[float]] = {name: [] for name in setups}
    comm: dict[str, dict] = {}
    for name, (model, opt, _, _) in setups.items():
        run_steps(model, opt, [batch()])  # warm-up: the optimizer state made
    rows[0] = 0
    for _ in range(args.rounds):
        for name, (model, opt, _, _) in setups.items():
            dist.barrier()
            times[name] += run_steps(model, opt, [batch() for _ in range(args.steps)])
            comm[name] = zs.comm_stats(model)
    steps_ep = args.rounds * args.steps
    a2a_bytes = 4 * rows[0] * args.hidden * 4 / steps_ep  # dispatch + combine, forward + backward, fp32
    mine = {name: {"rank": rank, "median_step_s": statistics.median(t), "steps_s": t,
                   "whole_expert_MiB": s[2] / MiB, "held_expert_MiB": s[3] / MiB,
                   "engine_sent_MiB_per_step": comm[name]["sent_bytes"] / MiB,
                   "all_to_all_sent_MiB_per_step": a2a_bytes / MiB if name == "ep" else 0.0}
            for (name, s), t in zip(setups.items(), times.values())}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:
        print(f"{'path':8s} {'median step':>12s} {'experts held':>14s} {'engine sends':>14s} {'all-to-all sends':>17s}")
        for name in setups:
            worst = max((r[name] for r in every), key=lambda r: r["median_step_s"])
            print(f"{name:8s} {worst['median_step_s']:10.3f} s {worst['held_expert_MiB']:10.2f} MiB "
                  f"{worst['engine_sent_MiB_per_step']:10.2f} MiB {worst['all_to_all_sent_MiB_per_step']:13.2f} MiB")
        ratio = (max(r["ep"]["median_step_s"] for r in every) / max(r["gather"]["median_step_s"] for r in every))
        print(f"ep / gather step time: {ratio:.2f}")
        with open(args.out, "w") as f:
            recorded = {k: v for k, v in vars(args).items() if k != "worker"}
            recorded["out"] = os.path.relpath(args.out, os.path.dirname(HERE))  # no path of this machine
            json.dump({"args": recorded, "ranks": every,
                       "ep_over_gather_step": ratio, "loadavg_before": load_before,
                       "loadavg_after": os.getloadavg()}, f, indent=1)
    for model, *_ in setups.values():
        zs.teardown(model, keep_weights=False)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29631",
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    return subprocess.call(cmd)


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    else:
        sys.exit(main())
