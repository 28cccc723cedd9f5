"""CPU benchmark: Muon + AdamW (the ownership layout) beside AdamW (the flat layout), 2 ranks, gloo.

Per model (a 16M GPT-2: 4 layers, 256 wide, GPT-2's vocabulary; a Llama from a config: 4 layers,
256 wide, MLP 688, vocabulary 2000), in the same process from the same weights, at stage 2:

* ``adamw_flat``: one AdamW over every parameter, flat shards;
* ``muon_adamw_owned``: torch's Muon recipe, Muon for the blocks' 2-D matrices (each owned whole by
  one rank) and AdamW for embeddings, norms and biases (flat shards), as two optimizers.

The systems take turns (round-robin, the order rotated each round); each figure is the median over
rounds of the slower rank's mean step time, with the 1-minute load average read beside it. Also per
rank: the optimizer-state bytes measured from the optimizer's tensors against the formula (AdamW 8
bytes per element of its 1/N shard, Muon 4 bytes per element it owns; the ideal Muon share is the
Muon elements / N), the elements per step of the collectives (``comm_stats``, both optimizers'
steps) against the flat layout's 2 x padded parameters, and the most loaded rank's Muon elements
over the mean. The machine is shared: compare ratios measured side by side, not absolutes.

Usage (from the repository root)::

    python benchmarks/owned_bench.py                 # both models, 3 rounds of 4 steps
    python benchmarks/owned_bench.py --rounds 1 --steps 2 --models llama   # quick check

It re-launches itself with ``python -m torch.distributed.run --nproc-per-node 2``; rank 0 prints
the table and writes ``benchmarks/out/owned_bench.json``.
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
DEFAULT_OUT = os.path.join(HERE, "out", "owned_bench.json")
SYSTEMS = ("adamw_flat", "muon_adamw_owned")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3)
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


def build_model(name: str, seq: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=seq, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, use_cache=False)
        return GPT2LMHeadModel(cfg), ".h."
    cfg = LlamaConfig(vocab_size=2000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg), ".layers."


def optimizers(model, system: str, block: str):
    import torch

    if system == "adamw_flat":
        return [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)]
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and block in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and block in n)]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.01)]


def state_bytes(zopt) -> int:
    seen, total = set(), 0
    for state in zopt.optimizer.state.values():
        for v in state.values():
            if hasattr(v, "untyped_storage") and v.numel() > 1 and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                total += v.numel() * v.element_size()
    return total


def formula(engine, zopts) -> tuple[int, int]:
    """(optimizer-state bytes this rank should hold, the ideal with the Muon elements spread evenly)."""
    mine = ideal = 0
    for z in zopts:
        for g in z.groups:
            if g.owned:  # Muon: one 4-byte momentum per element it owns
                mine += 4 * sum(s.numel for s, _ in g.owned_slots())
                ideal += 4 * g.numel / g.world_size
            else:  # AdamW: two 4-byte moments per element of the shard
                mine += 8 * g.shard_numel
                ideal += 8 * g.shard_numel
    return mine, int(ideal)


def worker(args) -> None:
    import copy

    import torch
    import torch.distributed as dist

    import zero_strategy as zs

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {"world_size": world, "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
              "sizes": []}
    for name in args.models:
        base, block = build_model(name, args.seq)
        vocab = base.config.vocab_size
        runs = {}
        for system in SYSTEMS:
            model = copy.deepcopy(base)
            model, zopts = zs.setup(model, optimizers(model, system, block), zs.ZeroConfig(stage=args.stage))
            runs[system] = (model, zopts, [])
        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)

        def step(model, zopts) -> int:
            model(input_ids=ids, labels=ids).loss.backward()
            volume = 0
            for z in zopts:
                z.step()
                volume += zs.comm_stats(model).get("volume_elements", 0)
            for z in zopts:
                z.zero_grad()
            return volume

        volumes = {}
        for system, (model, zopts, _) in runs.items():
            volumes[system] = step(model, zopts)  # warm-up, and the state is built
        for r in range(args.rounds):
            order = SYSTEMS[r % 2:] + SYSTEMS[:r % 2]
            for system in order:
                model, zopts, times = runs[system]
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step(model, zopts)
                dt = torch.tensor((time.perf_counter() - t0) / args.steps)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times.append((dt.item(), os.getloadavg()[0]))
        systems = {}
        for system, (model, zopts, times) in runs.items():
            engine = zs.api._engine_of(model)
            measured = torch.tensor([float(sum(state_bytes(z) for z in zopts))])
            gathered = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(gathered, measured)
            want, ideal = formula(engine, zopts)
            owned = [sum(s.numel for s, _ in g.owned_slots()) for z in zopts for g in z.groups if g.owned]
            owned_t = torch.tensor([float(sum(owned))])
            owned_all = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(owned_all, owned_t)
            owned_all = [x.item() for x in owned_all]
            params = sum(g.numel for g in engine.groups if g.trainable)
            flat = sum(-(-g.numel // world) * world for g in engine.groups if g.trainable)
            systems[system] = dict(
                step_s=statistics.median(t for t, _ in times), load=statistics.median(l for _, l in times),
                opt_state_bytes_rank0=int(gathered[0].item()), opt_state_bytes_max=int(max(x.item() for x in gathered)),
                formula_bytes_rank0=want, ideal_bytes_rank0=ideal,
                comm_elements=volumes[system], flat_comm_elements=2 * flat, params=params,
                muon_max_over_mean=(max(owned_all) / (sum(owned_all) / world)) if sum(owned_all) else None,
                memory_rank0_bytes=zs.memory_report(model).by_category)
        base_time = systems["adamw_flat"]["step_s"]
        for s in systems.values():
            s["time_vs_adamw_flat"] = s["step_s"] / base_time
        report["sizes"].append(dict(model=name, params=sum(p.numel() for p in base.parameters()), systems=systems))
        for model, _, _ in runs.values():
            zs.teardown(model)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        for size in report["sizes"]:
            print(f"\n{size['model']} ({size['params'] / 1e6:.1f}M params), stage {args.stage}, {world} ranks")
            for system, s in size["systems"].items():
                print(f"  {system:18s} {s['step_s']:.3f} s/step ({s['time_vs_adamw_flat']:.2f}x) load {s['load']:.1f}  "
                      f"opt state rank0 {s['opt_state_bytes_rank0'] / 2**20:.1f} MiB (formula "
                      f"{s['formula_bytes_rank0'] / 2**20:.1f}, ideal {s['ideal_bytes_rank0'] / 2**20:.1f}) "
                      f"comm {s['comm_elements'] / 1e6:.2f}M el (flat {s['flat_comm_elements'] / 1e6:.2f}M)  "
                      f"muon max/mean {s['muon_max_over_mean'] or 0:.3f}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
