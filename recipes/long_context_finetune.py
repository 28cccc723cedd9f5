"""Train a small causal language model on long sequences with Ulysses sequence parallelism: each
of the 2 processes holds half of every sequence, and the tiled loss never makes the
(tokens x vocabulary) logits whole.

The one command (2 CPU processes; on a GPU machine, one per GPU)::

    python -m torch.distributed.run --nproc-per-node 2 recipes/long_context_finetune.py \\
        --seq-len 8192 --steps 30 --output-dir recipes/out/long-context

What it does: a Llama-style decoder (``--size small``: 4 layers, hidden 256, 8 heads of 32,
4 kv heads; 16.8M parameters with the 30,522-token vocabulary) built from its config with
transformers' initialization (there is no hub here, so no pretrained weights), set up with
``zero_strategy.setup(model, optimizer, {"preset": "zero3", "sequence_parallel_size": 2,
"tiled_loss": True})``. The text (recipes/text.py) is the installed torch package's
docstrings, cut into ``--seq-len``-token sequences; every step trains on one whole sequence,
split over the SP group by ``zero_strategy.shard_sequence`` (each rank gets its half with
``shift_labels`` and global ``position_ids``); the model computes its shard's loss chunk by
chunk (``model(..., shift_labels=...)``, ``outputs.logits`` is None) and
``zero_strategy.sequence_parallel_loss`` makes it the whole sequence's loss on every rank.
More processes than ``--sp``: the rest is data parallel (one sequence per SP group and step).

Each logged step prints the loss, tokens per second and each rank's peak anonymous memory
(``/proc/self/status``); the end prints the held-out loss (the last 5% of the sequences,
computed the same tiled way, without gradients) and writes ``result.json`` to
``--output-dir``. ``--sp 1`` runs the same loop without sequence parallelism, for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import anon_bytes, join, leave, log  # noqa: E402  (recipes/processes.py)
from text import load_tokenizer, token_blocks  # noqa: E402  (recipes/text.py)

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per training sequence")
    p.add_argument("--sp", type=int, default=2, help="sequence_parallel_size (ranks sharing one sequence)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--size", choices=SIZES, default="small")
    p.add_argument("--preset", default="zero3")
    p.add_argument("--no-tiled-loss", action="store_true", help="the model's own loss (whole logits) instead")
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: the MiniLM package's)")
    p.add_argument("--output-dir", default="recipes/out/long-context")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)




def main(argv=None) -> None:
    args = parse_args(argv)
    join(timeout_minutes=10)
    from transformers import LlamaConfig, LlamaForCausalLM

    import zero_strategy as zs

    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.sp:
        raise SystemExit(f"--sp {args.sp} must divide the number of processes ({world})")
    tokenizer = load_tokenizer(args.tokenizer)
    train, held = token_blocks(tokenizer, args.seq_len)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=max(args.seq_len, 2048),
                         tie_word_embeddings=False, attn_implementation="sdpa", **SIZES[args.size])
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = zs.setup(model, optimizer, {"preset": args.preset, "sequence_parallel_size": args.sp,
                                                    "tiled_loss": not args.no_tiled_loss})
    model.train()
    dp, dp_rank = world // args.sp, rank // args.sp
    log(f"{n_params / 1e6:.1f}M parameters; {len(train)} train / {len(held)} held-out sequences of {args.seq_len} "
        f"tokens; {world} processes: {dp} data-parallel x sp {args.sp} ({args.seq_len // args.sp} tokens per rank), "
        f"{args.preset}, tiled loss {'off' if args.no_tiled_loss else 'on'}")

    def sequence_loss(block: torch.Tensor) -> torch.Tensor:
        shard = zs.shard_sequence({"input_ids": block[None], "labels": block[None]}, model)
        out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                    shift_labels=shard["shift_labels"])
        return zs.sequence_parallel_loss(out.loss, shard["shift_labels"], model)

    losses, peak = [], 0
    started = time.time()
    for step in range(1, args.steps + 1):
        t0 = time.time()
        block = train[((step - 1) * dp + dp_rank) % len(train)]
        loss = sequence_loss(block)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean)  # every rank of an SP group holds its sequence's loss: the mean over sequences
        losses.append(mean.item() / world)
        peak = max(peak, anon_bytes())
        if step % args.log_every == 0 or step in (1, args.steps):
            peaks = [None] * world
            dist.all_gather_object(peaks, peak)
            log(f"step {step}: loss {losses[-1]:.4f}, {dp * args.seq_len / (time.time() - t0):.0f} tokens/s, "
                "peak memory per rank " + " ".join(f"{p / 2**20:.0f} MiB" for p in peaks))
    train_time = time.time() - started

    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():  # the same tiled loss (training mode: Llama has no dropout), no gradients
        for i in range(dp_rank, len(held), dp):
            total += torch.tensor([sequence_loss(held[i]).item(), 1.0], dtype=torch.float64)
    dist.all_reduce(total)
    held_loss = (total[0] / total[1]).item()  # each sequence counted once per rank of its SP group
    result = {"seq_len": args.seq_len, "sp": args.sp, "processes": world, "steps": args.steps,
              "parameters": n_params, "first_loss": losses[0], "final_loss": losses[-1], "held_out_loss": held_loss,
              "train_seconds": round(train_time, 1), "peak_anon_mib_rank0": round(peak / 2**20, 1)}
    if rank == 0:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))
    log(f"final: {args.steps} steps on sequences of {args.seq_len} tokens (sp {args.sp}: {args.seq_len // args.sp} "
        f"per rank), train loss {losses[0]:.4f} -> {losses[-1]:.4f}, held-out loss {held_loss:.4f}, "
        f"{train_time:.0f} s")
    zs.teardown(model)
    leave()


if __name__ == "__main__":
    main()
