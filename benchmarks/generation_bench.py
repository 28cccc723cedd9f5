"""CPU benchmark: ``generate()`` at stage 3, gathering each unit once vs per unit, vs a plain unsharded model.

2 ranks, gloo, one thread per rank, a Llama from ``transformers`` built from a config
(default ~7M parameters: 8 layers, hidden 256, vocabulary 2000; bigger than the tests'),
greedy generation of ``--new-tokens`` tokens for ``--batch`` prompts of ``--prompt`` tokens
on each rank. Systems, built in the same process from the same weights:

* ``stock``: the plain model, whole on every rank (what the stock trainer's DDP model
  generates with: ``ddp.module.generate``);
* ``once``: set up at stage 3 with every parameter sharded (``param_persistence_threshold=0``),
  ``with zero_strategy.gathered_for_generation(model): model.generate(...)``;
* ``per_unit``: the same model without the block: every new token gathers every unit;
* ``once_offload`` / ``per_unit_offload`` (``--offload``): the same on ``zero3_offload``.

The systems take turns (round-robin, the order rotated each round) so machine noise hits
all alike; each figure is the median over rounds of the slower rank's time for one
generate(), with the 1-minute load average read beside it. Reported: tokens/s per rank,
the ratio of each system's time to ``stock``'s, of the medians and paired (the median over
rounds of the ratio within one round, less exposed to load that changes between rounds;
the target for ``once``: within 1.2x),
all-gathers per generate(), and whether every system generated ``stock``'s tokens. The
machine is shared: figures are noisy, ratios measured side by side are what mean anything.

Usage (from the repository root)::

    python benchmarks/generation_bench.py                  # default model, 9 rounds
    python benchmarks/generation_bench.py --rounds 2 --new-tokens 16   # quick check
    python benchmarks/generation_bench.py --offload

It re-launches itself with ``python -m torch.distributed.run --nproc-per-node 2``; rank 0
prints the table and writes ``benchmarks/out/generation_bench.json``.
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
DEFAULT_OUT = os.path.join(HERE, "out", "generation_bench.json")
TARGET = 1.2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--batch", type=int, default=4, help="prompts per rank")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--offload", action="store_true", help="add the zero3_offload systems")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def launch(args) -> int:
    """Run this script under torch.distributed.run; success is the JSON rank 0 writes."""
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if os.path.exists(args.out):
        os.remove(args.out)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    subprocess.run(cmd, env=env, cwd=REPO, timeout=1800)
    return 0 if os.path.exists(args.out) else 1


def build_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75),
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=args.prompt + args.new_tokens + 8, tie_word_embeddings=False,
                      pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def worker(args) -> None:
    import copy
    import datetime

    import torch
    import torch.distributed as dist

    import zero_strategy as zs

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    plain = build_model(args)
    n_params = sum(p.numel() for p in plain.parameters())
    configs = {"once": "zero3", "per_unit": "zero3"}
    if args.offload:
        configs.update(once_offload="zero3_offload", per_unit_offload="zero3_offload")
    models = {"stock": plain}
    for name, preset in configs.items():
        cfg = zs.ZeroConfig.preset(preset, param_persistence_threshold=0)
        models[name] = zs.setup(copy.deepcopy(plain), None, cfg)[0]
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=g)

    def run(name: str):
        model = models[name]
        gathered = zs.gathered_for_generation(model) if name.startswith("once") else None
        gathers_before = zs.api._engine_of(model).comm.stats.all_gather.calls if zs.is_set_up(model) else 0
        dist.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            if gathered is not None:
                with gathered:
                    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                         max_new_tokens=args.new_tokens, pad_token_id=0)
            else:
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=args.new_tokens, pad_token_id=0)
        seconds = time.perf_counter() - start
        gathers = (zs.api._engine_of(model).comm.stats.all_gather.calls - gathers_before) if zs.is_set_up(model) else 0
        slowest = torch.tensor([seconds])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest), gathers, out

    names = list(models)
    tokens = {name: run(name)[2] for name in names}  # warm-up, and the outputs to compare
    same = {name: bool(torch.equal(tokens[name], tokens["stock"])) for name in names}
    times = {name: [] for name in names}
    loads = {name: [] for name in names}
    gathers = {}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds, gathers[name], _ = run(name)
            times[name].append(seconds)
            loads[name].append(os.getloadavg()[0])
    if rank == 0:
        report(args, n_params, names, times, loads, gathers, same)
    dist.barrier()
    dist.destroy_process_group()


def report(args, n_params, names, times, loads, gathers, same) -> None:
    tokens = args.batch * args.new_tokens
    stock = statistics.median(times["stock"])
    paired = {name: statistics.median(t / s for t, s in zip(times[name], times["stock"])) for name in names}
    rows = []
    print(f"\ngenerate(): {n_params / 1e6:.1f}M params, {args.nproc} ranks, {args.batch} prompts x {args.prompt} "
          f"tokens, {args.new_tokens} new tokens per rank, {args.rounds} rounds")
    print(f"{'system':<18}{'s/generate':>11}{'tokens/s':>10}{'vs stock':>10}{'paired':>9}{'gathers':>9}"
          f"{'same tokens':>13}{'load avg':>10}")
    for name in names:
        med = statistics.median(times[name])
        row = {"system": name, "seconds_per_generate": med, "tokens_per_s_per_rank": tokens / med,
               "ratio_to_stock": med / stock, "paired_ratio_to_stock": paired[name],
               "all_gathers_per_generate": gathers[name],
               "same_tokens_as_stock": same[name], "loadavg_1min": statistics.mean(loads[name]),
               "seconds_all_rounds": times[name]}
        rows.append(row)
        print(f"{name:<18}{med:>11.4f}{row['tokens_per_s_per_rank']:>10.1f}{row['ratio_to_stock']:>9.2f}x"
              f"{paired[name]:>8.2f}x{gathers[name]:>9}{str(same[name]):>13}{row['loadavg_1min']:>10.2f}")
    once = next(r for r in rows if r["system"] == "once")
    per_unit = next(r for r in rows if r["system"] == "per_unit")
    print(f"gather-once / stock: {once['ratio_to_stock']:.2f}x of the medians, {once['paired_ratio_to_stock']:.2f}x "
          f"paired per round (target <= {TARGET}x); "
          f"per-unit / gather-once: {per_unit['seconds_per_generate'] / once['seconds_per_generate']:.2f}x")
    result = {"args": {k: v for k, v in vars(args).items() if k != "worker"}, "params": n_params,
              "cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg(), "rows": rows, "target": TARGET}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2)
    os.replace(tmp, args.out)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
