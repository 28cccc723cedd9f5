"""One-GPU benchmark: plain GPU training vs zero_strategy ZeRO-1/2/3 (bf16), one run.

The anchor model of ../shared/ANCHORS.md: a Llama-style ``LlamaForCausalLM`` with
940.6M parameters (hidden 2048, 16 layers, 16 heads, intermediate 5504, vocab
32000, SDPA attention), batch 8 x 2048 tokens of random ids, the same batch every
step, world size 1 (no process group needed: ``zs.setup`` runs as a world of one).

Systems, one after another, each from the same seed and with everything freed in
between:

* ``plain``: fp32 parameters on the GPU, ``torch.autocast(bfloat16)``,
  ``torch.optim.AdamW(fused=True)``;
* ``zero1`` / ``zero2`` / ``zero3``: ``zs.setup(model, AdamW(fused=True),
  ZeroConfig(stage=s, precision="bf16"))`` (no offload).

Per system: seconds per step (median of ``--steps`` after ``--warmup``, with
``torch.cuda.synchronize``), TFLOP/s = 6 * params * tokens / step time, peak GPU
memory (``torch.cuda.max_memory_allocated`` from after set-up through the steps;
the set-up peak is reported separately), the loss of every step and the ratio to
``plain``. Out-of-memory or any other failure of one system is recorded and the
next system runs. A hard time budget (``--budget``, 270 s) skips whatever is left.

    python benchmarks/gpu_bench.py                     # H200: well under 5 minutes
    python benchmarks/gpu_bench.py --small             # 2 layers, hidden 256
    python benchmarks/gpu_bench.py --small --device cpu  # smoke test without a GPU

Writes ``$OUT/gpu_bench.json`` if ``OUT`` is set, else ``benchmarks/out/gpu_bench.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SYSTEMS = ("plain", "zero1", "zero2", "zero3")

try:
    import zero_strategy as zs
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(REPO, "src"))
    import zero_strategy as zs

import torch

T_START = time.perf_counter()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="2 layers, hidden 256 (smoke test)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test only)")
    p.add_argument("--batch", type=int, default=None, help="default 8 (--small: 2)")
    p.add_argument("--seq", type=int, default=None, help="default 2048 (--small: 128)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--budget", type=float, default=270.0,
                   help="seconds since start after which remaining systems/steps are skipped")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_bench.json or benchmarks/out/)")
    a = p.parse_args(argv)
    if a.batch is None:
        a.batch = 2 if a.small else 8
    if a.seq is None:
        a.seq = 128 if a.small else 2048
    if a.out is None:
        base = os.environ.get("OUT") or os.path.join(HERE, "out")
        a.out = os.path.join(base, "gpu_bench.json")
    return a


def elapsed() -> float:
    return time.perf_counter() - T_START


def is_cuda(dev: torch.device) -> bool:
    return dev.type == "cuda"


def sync(dev):
    if is_cuda(dev):
        torch.cuda.synchronize(dev)


def make_model(a, dev):
    from transformers import LlamaConfig, LlamaForCausalLM
    if a.small:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=max(2048, a.seq))
    else:
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16,
                          num_key_value_heads=16, vocab_size=32000, max_position_embeddings=max(2048, a.seq))
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    model.train()
    return model


def make_batch(a, dev, vocab):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(dev)


def mem_gib(dev, peak=True):
    if not is_cuda(dev):
        return None
    return (torch.cuda.max_memory_allocated(dev) if peak else torch.cuda.memory_allocated(dev)) / 2**30


def free_all(dev):
    gc.collect()
    if is_cuda(dev):
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def run_system(name, a, dev, ids, res):
    """Build, train ``warmup + steps`` steps, fill ``res``; everything local is freed on return."""
    if is_cuda(dev):
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    model = make_model(a, dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)
    zopt = None
    if name == "plain":
        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=int(name[-1]), precision="bf16"))

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            zopt.backward(loss)
            zopt.step()
            zopt.zero_grad()
            return loss
    sync(dev)
    res.update(params=n_params, setup_s=time.perf_counter() - t0, setup_peak_gib=mem_gib(dev))
    if is_cuda(dev):
        torch.cuda.reset_peak_memory_stats(dev)
    times, losses = [], []
    try:
        for i in range(a.warmup + a.steps):
            if elapsed() > a.budget:
                res["note"] = f"stopped after {i} steps: time budget {a.budget:.0f} s spent"
                break
            sync(dev)
            t = time.perf_counter()
            loss = step()
            sync(dev)
            dt = time.perf_counter() - t
            losses.append(float(loss.detach().float().item()))
            if i >= a.warmup:
                times.append(dt)
            print(f"[gpu_bench] {name} step {i}: {dt:.3f} s loss {losses[-1]:.4f}", flush=True)
        res.update(step_times_s=times, losses=losses, peak_gib=mem_gib(dev))
        if zopt is not None:
            rep = zs.memory_report(model)
            res["model_state_gib"] = {k: v / 2**30 for k, v in rep.by_category.items()}
    finally:
        del step, model, opt, zopt  # a set-up model is collected like any other
        gc.collect()


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = torch.device(a.device)
    if is_cuda(dev) and not torch.cuda.is_available():
        print("gpu_bench: CUDA is not available; use --small --device cpu for a smoke test", file=sys.stderr)
        return 2
    import transformers
    wanted = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in wanted if s not in SYSTEMS]
    if bad:
        print(f"gpu_bench: unknown systems {bad}; choose from {SYSTEMS}", file=sys.stderr)
        return 2
    vocab = 32000
    ids = make_batch(a, dev, vocab)
    tokens = a.batch * a.seq
    report = {
        "benchmark": "gpu_bench", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "python benchmarks/gpu_bench.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name(dev) if is_cuda(dev) else platform.processor() or "cpu",
        "model": "LlamaForCausalLM " + ("small (2L, hidden 256)" if a.small else "anchor (16L, hidden 2048)"),
        "batch": [a.batch, a.seq], "tokens_per_step": tokens, "warmup": a.warmup, "steps": a.steps,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                     "zero_strategy": zs.__version__, "python": sys.version.split()[0]},
        "budget_s": a.budget, "systems": {},
    }
    for name in wanted:
        res = {"system": name}
        report["systems"][name] = res
        if elapsed() > a.budget:
            res["status"] = f"skipped: time budget {a.budget:.0f} s spent"
            continue
        free_all(dev)
        res["gib_in_use_before"] = mem_gib(dev, peak=False)
        t0 = time.perf_counter()
        try:
            run_system(name, a, dev, ids, res)
            res["status"] = "ok" if res.get("step_times_s") else "no timed steps"
        except torch.cuda.OutOfMemoryError as e:
            res["status"] = "OOM"
            res["error"] = str(e).splitlines()[0][:300]
            res["peak_gib"] = mem_gib(dev)
        except Exception as e:  # noqa: BLE001 - record and go on to the next system
            traceback.print_exc()
            res["status"] = "error"
            res["error"] = f"{type(e).__name__}: {e}"[:500]
        res["wall_s"] = time.perf_counter() - t0
        free_all(dev)
        print(f"[gpu_bench] {name}: {res['status']} in {res['wall_s']:.1f} s (total {elapsed():.0f} s)", flush=True)

    plain = report["systems"].get("plain", {})
    plain_s = statistics.median(plain["step_times_s"]) if plain.get("step_times_s") else None
    for res in report["systems"].values():
        if res.get("step_times_s"):
            s = statistics.median(res["step_times_s"])
            res["step_s"] = s
            res["tflops"] = 6 * res["params"] * tokens / s / 1e12
            res["ratio_vs_plain"] = s / plain_s if plain_s else None
    report["total_wall_s"] = elapsed()
    print(format_table(report), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"gpu_bench: wrote {a.out} ({report['total_wall_s']:.0f} s)")
    return 0


def format_table(rep) -> str:
    cols = ["system", "s/step", "vs plain", "TFLOP/s", "peak GiB", "setup s", "losses"]
    rows = []
    for name, r in rep["systems"].items():
        if "step_s" not in r:
            rows.append([name, f"{r.get('status', '?')} {r.get('error', '')}".strip()])
            continue
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        rows.append([name, f"{r['step_s']:.3f}", f(r.get("ratio_vs_plain"), ".3f"), f"{r['tflops']:.1f}",
                     f(r.get("peak_gib"), ".1f"), f"{r['setup_s']:.1f}",
                     " ".join(f"{x:.4f}" for x in r["losses"])])
    full = [r for r in rows if len(r) == len(cols)]
    w = [max([len(c)] + [len(r[i]) for r in full]) for i, c in enumerate(cols)]
    fmt = lambda r: "  ".join(c.ljust(w[i]) if i in (0, len(cols) - 1) else c.rjust(w[i])  # noqa: E731
                              for i, c in enumerate(r))
    out = [f"{rep['model']}, batch {rep['batch'][0]}x{rep['batch'][1]}, {rep['device']}, "
           f"median of {rep['steps']} steps after {rep['warmup']} warm-up",
           fmt(cols), "  ".join("-" * x for x in w)]
    for r in rows:
        out.append(fmt(r) if len(r) == len(cols) else f"{r[0].ljust(w[0])}  {r[1]}")
    out.append("plain: fp32 params + bf16 autocast + fused AdamW; zeroN: zero_strategy stage N, precision bf16, "
               "fused AdamW on fp32 master shards; world size 1. TFLOP/s = 6*params*tokens/step.")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
