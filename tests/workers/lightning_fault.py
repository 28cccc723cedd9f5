"""``training_step`` raises on rank 1 at its third batch under ``Trainer.fit``; each rank reports how
it left. ``args``: ``strategy`` ("ddp" or a preset name, as a user writes it).

Rank 1 writes the time it raised into ``fail_time``. Lightning initializes the process
group itself, with its default timeout (30 minutes), as in a user's run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import zero_strategy  # noqa: F401 - registers the presets
import lightning.pytorch as pl

from _models import SEQ, VOCAB, TinyLM, loss_fn

FAIL_BATCH = 2


class Failing(pl.LightningModule):
    def __init__(self, out: Path):
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLM(layers=2)
        self.out = out

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = loss_fn(self.model(tokens), targets)
        if self.global_rank == 1 and batch_idx == FAIL_BATCH:
            (self.out / "fail_time").write_text(repr(time.time()))
            raise RuntimeError("injected failure in training_step on rank 1")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    data = DataLoader(TensorDataset(tokens, torch.roll(tokens, -1, dims=1)), batch_size=4)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=args["strategy"], max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    report = dict(error=None, message="")
    try:
        trainer.fit(Failing(out), data)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        report = dict(error=type(e).__name__, message=str(e))
        raise
    finally:
        report["left"] = time.time()
        (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
