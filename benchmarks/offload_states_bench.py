"""What an ``offload_states`` / ``reload_states`` round trip moves and costs, per preset.

One process (a world of one) on the CUDA device if there is one, else the CPU: a
Llama-style model (``--dim``, ``--layers``) trains ``--warmup`` steps, then each of
``--repeats`` rounds offloads the training-only kinds (optimizer state, masters,
gradients: what a rollout does not need) and everything, and reloads. The table gives
the bytes ``memory_report`` counts as moved, the device bytes the allocator freed (CUDA
only; on a CPU-only machine the device is host memory and nothing is freed in net), the
median offload and reload times and their bandwidth, next to the median step time.

    python benchmarks/offload_states_bench.py                      # ~30 s on 2 CPU cores
    python benchmarks/offload_states_bench.py --dim 2048 --layers 8 --presets zero3 zero2

Prints a Markdown table with the load average (this machine is shared: figures are noisy)
and writes benchmarks/out/offload_states.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import zero_strategy as zs  # noqa: E402

TRAINING_ONLY = ["optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer"]
CONFIGS = {
    "zero1": dict(stage=1, precision="bf16"),
    "zero2": dict(stage=2, precision="bf16"),
    "zero3": dict(stage=3, precision="bf16", param_persistence_threshold=0),
    "zero2_offload": dict(preset="zero2_offload", precision="bf16"),
}


def model_of(dim: int, layers: int, vocab: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=4 * dim, num_hidden_layers=layers,
                         num_attention_heads=max(1, dim // 64), num_key_value_heads=max(1, dim // 128),
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def run(name: str, args, device: torch.device) -> list[dict]:
    model = model_of(args.dim, args.layers, args.vocab).to(device)
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), zs.ZeroConfig.from_dict(CONFIGS[name]))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    steps = []
    for i in range(args.warmup + args.repeats):
        sync(device)
        t0 = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad()
        sync(device)
        if i >= args.warmup:
            steps.append(time.perf_counter() - t0)
    rows = []
    for label, include in (("training only", TRAINING_ONLY), ("everything", None)):
        offs, rels, moved, freed = [], [], 0, 0
        for _ in range(args.repeats):
            before = zs.memory_report(model).device_bytes
            held = allocated(device)
            t0 = time.perf_counter()
            zs.offload_states(model, opt, include=include)
            sync(device)
            t1 = time.perf_counter()
            moved, freed = before - zs.memory_report(model).device_bytes, held - allocated(device)
            zs.reload_states(model)
            sync(device)
            offs.append(t1 - t0)
            rels.append(time.perf_counter() - t1)
        off, rel = statistics.median(offs), statistics.median(rels)
        rows.append(dict(preset=name, kinds=label, moved_bytes=moved, freed_device_bytes=freed,
                         offload_ms=1e3 * off, reload_ms=1e3 * rel, offload_gbs=moved / off / 1e9 if off else 0.0,
                         reload_gbs=moved / rel / 1e9 if rel else 0.0, step_ms=1e3 * statistics.median(steps),
                         load_average=os.getloadavg()[0]))
    zs.teardown(model, keep_weights=False)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = [r for name in args.presets for r in run(name, args, device)]
    print(f"device {device}; load average {os.getloadavg()[0]:.1f} (shared machine: figures are noisy); "
          f"dim {args.dim}, {args.layers} layers, vocab {args.vocab}\n")
    print("| preset | kinds | moved MiB | device freed MiB | offload ms (GB/s) | reload ms (GB/s) | step ms | load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        freed = f"{r['freed_device_bytes'] / 2**20:.1f}" if device.type == "cuda" else "n/a (CPU)"
        print(f"| {r['preset']} | {r['kinds']} | {r['moved_bytes'] / 2**20:.1f} | {freed} | "
              f"{r['offload_ms']:.1f} ({r['offload_gbs']:.1f}) | {r['reload_ms']:.1f} ({r['reload_gbs']:.1f}) | "
              f"{r['step_ms']:.0f} | {r['load_average']:.1f} |")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    (out / "offload_states.json").write_text(json.dumps(dict(args=vars(args), device=str(device), rows=rows), indent=1))


if __name__ == "__main__":
    main()
