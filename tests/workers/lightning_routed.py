"""A LLaVA-style LightningModule whose ranks' batches differ in having images, under
``Trainer(strategy="ddp_find_unused_parameters_true")`` (the oracle, as Lightning's docs
tell DDP users with unused parameters) and under ZeRO presets.

The data goes through Lightning's own DistributedSampler (rank r gets rows r, r+2, ...):
rank 0's rows have images except at step 1, rank 1's never do, so step 0 and steps 2-3
run the vision tower and projector on rank 0 only and step 1 on no rank. Each strategy
reports the final full weights (``module.state_dict()`` after fit), torch.saved by rank 0.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from _routed_models import SEQ, VOCAB, TinyVLM
from _worker import finish, run_named_cases, start

import zero_strategy  # noqa: F401 - registers the presets
import lightning.pytorch as pl

ROWS, STEPS = 2, 4


class LitVLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyVLM()

    def training_step(self, batch, batch_idx):
        tokens, pixels, has_image = batch
        logits = self.model(tokens[:, :-1], pixel_values=pixels if bool(has_image.all()) else None)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def loader(world: int) -> DataLoader:
    g = torch.Generator().manual_seed(5)
    n = ROWS * world * STEPS
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    row = torch.arange(n)
    has_image = (row % world == 0) & ((row // world) // ROWS != 1)  # rank 0's rows, not at step 1
    return DataLoader(TensorDataset(tokens, torch.randn(n, 3, 4, generator=g), has_image), batch_size=ROWS)


def main() -> None:
    args, out = start()
    world = dist.get_world_size()

    def run(case: dict) -> dict:
        module = LitVLM()
        trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=case["strategy"], max_epochs=1,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(module, loader(world))
        state = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
        if dist.get_rank() == 0:
            torch.save(state, os.path.join(str(out), f"{case['name']}.pt"))
        return {"global_step": trainer.global_step}

    finish(out, {"runs": run_named_cases([{"name": s, "strategy": s} for s in args["strategies"]], run,
                                         barrier=True)})


if __name__ == "__main__":
    main()
