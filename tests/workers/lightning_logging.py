"""A Trainer run whose setup makes the engine warn and log, as a user's script would be run.

The model has no repeated blocks, so stage 3 warns that it found no units; the DeepSpeed
config has a key the importer accepts without effect (logged at INFO); a DeepSpeedStrategy
argument without effect here warns. Logging is at INFO, warnings at their defaults. The
test reads each rank's output (tests/test_lightning_rank_zero_logging.py).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from _worker import finish, start

import zero_strategy
import lightning.pytorch as pl


class Flat(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(64, 64)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    args, out = start()
    logging.basicConfig(level=logging.INFO)
    ds_config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                       "reduce_bucket_size": 5e8}, "steps_per_print": 10}
    strategy = zero_strategy.ZeroStrategy(config=ds_config, overlap_comm=True)
    data = DataLoader(TensorDataset(torch.randn(8, 64)), batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Flat(), data)
    finish(out, {"global_step": trainer.global_step})


if __name__ == "__main__":
    main()
