"""A small, complete ZeroAccelerator training script (synthetic data, a tiny transformer-like model).

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml \
        recipes/accelerate/train_example.py --zero-config zero3 --out /tmp/zero_example

It is the ordinary Accelerate loop with ``Accelerator`` replaced by ``ZeroAccelerator``:
prepare, accumulate, backward, clip, step, save_state, save_model.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from zero_strategy.accelerate import ZeroAccelerator


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero-config", default=None,
                        help="preset name or YAML/JSON path; default: $ZERO_STRATEGY_CONFIG, else zero3")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--out", default="zero_example_out")
    args = parser.parse_args()

    accelerator = ZeroAccelerator(zero_config=args.zero_config, gradient_accumulation_steps=args.grad_accum)
    torch.manual_seed(0)
    data = torch.randint(0, 64, (args.steps * args.grad_accum * 4 * accelerator.num_processes, 16))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    for i, tokens in enumerate(loader):
        with accelerator.accumulate(model):
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            loss = accelerator.reduce(loss.detach(), "mean")
            accelerator.print(f"step {(i + 1) // args.grad_accum}: loss {loss.item():.4f} grad norm {norm.item():.3f}")

    accelerator.save_state(f"{args.out}/state")      # every rank's shard; load_state resumes on any #processes
    accelerator.save_model(model, f"{args.out}/model")  # consolidated safetensors, written by rank 0
    cfg = accelerator.zero_config
    accelerator.print(f"ZeRO stage {cfg.stage}, precision {cfg.precision}, {accelerator.num_processes} processes: "
                      f"saved to {args.out}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
