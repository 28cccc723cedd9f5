"""CPU benchmark: QLoRA under ZeRO-3, 2 ranks, gloo: the 4-bit base's bytes per rank against the
formula, and the step time beside LoRA on a bf16 base of the same model.

A Llama (hidden 512, 4 layers by default) is written once in fp32. Two systems, each in fresh
processes at ``zero3`` with ``param_persistence_threshold=0``, LoRA rank 16 on every linear layer
of the blocks, AdamW, 2 sequences of 128 tokens per rank:

* ``qlora``: transformers loads it with ``BitsAndBytesConfig(load_in_4bit=True, NF4, double quant,
  bnb_4bit_quant_storage=torch.bfloat16, compute bf16)``, PEFT adds the adapters, ``precision="bf16"``;
* ``qlora_uint8``: the same quantization in bitsandbytes' default uint8 storage, loaded sharded in one
  call, ``zero_strategy.transformers.from_pretrained(..., quantization_config=...)`` (each rank
  quantizes only its slices at ``setup``);
* ``lora_bf16``: the same model loaded in bf16, the same adapters, ``precision="bf16"``.

Reported per system and rank: the packed 4-bit bytes its flat groups hold at rest (qlora) beside
the formula ``0.5 x base parameters / N`` (plus padding), the quant states' bytes (whole on every
rank), for qlora_uint8 every uint8 byte a live tensor of the process holds (the garbage collector's
count, not the engine's: shards, placeholders and the double-quantized absmax), the frozen base
bytes it rests on (lora_bf16: ``2 x base parameters / N``), and the median step time of the timed
steps. The machine is shared, so the step times of ``qlora_uint8`` and ``lora_bf16`` are compared
interleaved: after the first round (all three systems), ``--rounds`` more rounds run the two
alone, alternating which goes first; the ratio is taken per round (each system's median step,
averaged over ranks) and its median over rounds reported, with the load average beside every
round.

Usage (from the repository root)::

    python benchmarks/qlora_bench.py            # hidden 512, 4 layers
    python benchmarks/qlora_bench.py --layers 2 --steps 3 --rounds 1

It re-launches itself with ``python -m torch.distributed.run --nproc-per-node 2`` per system;
the table is printed and ``benchmarks/out/qlora_bench.json`` written.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, "out", "qlora_bench.json")
SYSTEMS = ("qlora", "qlora_uint8", "lora_bf16")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=6, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds of qlora_uint8 and lora_bf16 alone, alternating, after the first round")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--worker", choices=SYSTEMS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def write_checkpoint(args, directory: str) -> None:
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                   num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=args.seq)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)


def worker(args) -> None:
    sys.path.insert(0, os.path.join(REPO, "src"))
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import zero_strategy as zs
    from zero_strategy.api import _engine_of as engine_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    if args.worker == "qlora":
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(args.dir, quantization_config=q, device_map="cpu",
                                                     dtype=torch.bfloat16)
        config = zs.ZeroConfig.preset("zero3", param_persistence_threshold=0, precision="bf16")
    elif args.worker == "qlora_uint8":
        from zero_strategy.transformers import from_pretrained
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)  # bnb_4bit_quant_storage: uint8
        model = from_pretrained(AutoModelForCausalLM, args.dir, quantization_config=q, dtype=torch.bfloat16)
        config = zs.ZeroConfig.preset("zero3", param_persistence_threshold=0, precision="bf16")
    else:
        model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16)
        config = zs.ZeroConfig.preset("zero3", param_persistence_threshold=0, precision="bf16")
    packed = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    base_params = (sum(p.quant_state.shape.numel() for p in packed) if packed else
                   sum(m.weight.numel() for name, m in model.named_modules()
                       if isinstance(m, torch.nn.Linear) and any(name.endswith(t) for t in TARGETS)))
    quant_state_bytes = sum(t.numel() * t.element_size() for p in packed
                            for t in _quant_state_tensors(p.quant_state))
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, zopt = zs.setup(model, opt, config)
    engine = engine_of(model)
    base_ids = {id(m.weight) for name, m in model.named_modules()
                if any(name.endswith(t + ".base_layer") for t in TARGETS)}
    held = sum(t.untyped_storage().nbytes() for g in engine.groups if any(id(s.param) in base_ids for s in g.slots)
               for cat, _, t in g.held_tensors() if cat == "params")
    ids = torch.randint(0, 2048, (2, args.seq), generator=torch.Generator().manual_seed(rank))
    times = []
    for step in range(args.steps + 2):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    bytes_per = 0.5 if packed else 2.0
    live = _live_bytes(torch.uint8) if args.worker == "qlora_uint8" else None
    report = dict(system=args.worker, rank=rank, world_size=n, base_params=base_params, base_bytes_held=held,
                  formula_bytes=bytes_per * base_params / n, quant_state_bytes=quant_state_bytes,
                  live_uint8_bytes=live, step_s=statistics.median(times), step_times=times, last_loss=loss.item(),
                  memory_report_params=zs.memory_report(model).by_category["params"])
    with open(os.path.join(args.dir, f"{args.worker}-rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def _live_bytes(dtype) -> int:
    """Bytes of every distinct storage of ``dtype`` a live tensor of this process points at, found by the
    garbage collector rather than the engine (uint8 storage: the packed shards, their placeholders and
    the double-quantized absmax; a whole copy left anywhere would show)."""
    import gc
    import torch
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.dtype == dtype and not obj.is_meta:
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _quant_state_tensors(state):
    out = [state.absmax, state.code]
    if getattr(state, "state2", None) is not None:
        out += [state.state2.absmax, state.state2.code]
    return [t for t in out if t is not None]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results, load, rounds = [], [os.getloadavg()], []
    pair = ("qlora_uint8", "lora_bf16")
    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(args, d)
        order = [SYSTEMS] + [pair if r % 2 else pair[::-1] for r in range(args.rounds)]
        for r, systems in enumerate(order):
            step, load_before = {}, os.getloadavg()
            for system in systems:
                rows = _run(args, d, system)
                if r == 0:
                    results += rows
                    load.append(os.getloadavg())
                step[system] = statistics.mean(row["step_s"] for row in rows)
            rounds.append(dict(order=list(systems), step_s=step, ratio=step["qlora_uint8"] / step["lora_bf16"],
                               loadavg=[load_before, os.getloadavg()]))
    print(f"{'system':<11}{'rank':>5}{'base params':>13}{'base MiB held':>15}{'formula MiB':>13}"
          f"{'quant state KiB':>17}{'live uint8 MiB':>16}{'step s':>9}")
    for r in results:
        print(f"{r['system']:<11}{r['rank']:>5}{r['base_params']:>13,}{r['base_bytes_held'] / 2**20:>15.3f}"
              f"{r['formula_bytes'] / 2**20:>13.3f}{r['quant_state_bytes'] / 2**10:>17.1f}"
              f"{'—' if r['live_uint8_bytes'] is None else format(r['live_uint8_bytes'] / 2**20, '.3f'):>16}"
              f"{r['step_s']:>9.3f}")
    step = {s: statistics.mean(r["step_s"] for r in results if r["system"] == s) for s in SYSTEMS}
    print(f"first round: step time qlora / lora_bf16: {step['qlora'] / step['lora_bf16']:.2f}x, qlora_uint8 / "
          f"lora_bf16: {step['qlora_uint8'] / step['lora_bf16']:.2f}x;  load average before and after "
          "each system: " + ", ".join(f"{a[0]:.1f}" for a in load))
    print("| round | order | qlora_uint8 step s | lora_bf16 step s | qlora_uint8 / lora_bf16 | load (1 min) before, after |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(rounds):
        print(f"| {i} | {', '.join(r['order'])} | {r['step_s']['qlora_uint8']:.3f} | {r['step_s']['lora_bf16']:.3f} | "
              f"{r['ratio']:.2f}x | {r['loadavg'][0][0]:.1f}, {r['loadavg'][1][0]:.1f} |")
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"median over {len(rounds)} rounds, qlora_uint8 / lora_bf16: {ratio:.2f}x")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(args={k: v for k, v in vars(args).items() if k not in ("worker", "dir", "out")},
                       results=results, step_ratio=step["qlora"] / step["lora_bf16"], rounds=rounds,
                       uint8_step_ratio_median=ratio, loadavg=load), f, indent=2)
    return 0


def _run(args, d: str, system: str) -> list[dict]:
    """One system in fresh processes on 2 ranks; its per-rank reports."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", os.path.abspath(__file__),
           "--worker", system, "--dir", d, "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--steps", str(args.steps), "--seq", str(args.seq)]
    subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True)
    rows = []
    for rank in range(2):
        with open(os.path.join(d, f"{system}-rank{rank}.json")) as f:
            rows.append(json.load(f))
    return rows


if __name__ == "__main__":
    sys.exit(main())
