"""PEFT LoRA in a LightningModule trained by ``Trainer(strategy=ZeroStrategy(...))`` at stages 1-3.

The LightningModule holds the PeftModel (``self.model``). In ``on_train_end``, while the
model is still sharded, every rank makes the PEFT calls (state dict, ``save_pretrained``
with ``is_main_process=trainer.is_global_zero``, ``generate()`` with a different length
per rank). After ``fit`` the engine stays (save_checkpoint / validate / test work); once
``trainer.strategy.teardown()`` released it on every rank the model is whole again, and the usual
Lightning idiom ``if trainer.is_global_zero: model.save_pretrained(d)`` is used, then ``merge_and_unload``.
Everything is compared with a plain PEFT model trained on the whole global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from _peft_models import after_training, batch, lora, reference, tiny_llama
from _worker import finish, start

import lightning.pytorch as pl
import zero_strategy

STEPS, WORLD, ROWS = 3, 2, 2


class LitLora(pl.LightningModule):
    def __init__(self, out, stage: int):
        super().__init__()
        self.model = lora(tiny_llama())
        self.out, self.stage, self.during_fit = out, stage, None
        self.batches_as_planned: list[bool] = []

    def training_step(self, b, batch_idx):
        ids = b[0]
        self.batches_as_planned.append(torch.equal(ids, batch(batch_idx, self.global_rank)))
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)

    def on_train_end(self):
        def save(m, directory):
            m.save_pretrained(directory, is_main_process=self.trainer.is_global_zero)
        ref = reference(STEPS, WORLD)
        self.during_fit = after_training(self.model, ref, self.out, f"lightning-s{self.stage}", self.global_rank,
                                         save, merge=False)


def loader() -> DataLoader:
    """Rank r's step k is ``batch(k, r)``, which the reference trains on beside the other ranks'.

    Ordered for an unshuffled DistributedSampler (index = step*ROWS*WORLD + row*WORLD + rank).
    """
    rows = [batch(step, r)[j] for step in range(STEPS) for j in range(ROWS) for r in range(WORLD)]
    data = TensorDataset(torch.stack(rows))
    sampler = DistributedSampler(data, num_replicas=WORLD, rank=dist.get_rank(), shuffle=False)
    return DataLoader(data, batch_size=ROWS, sampler=sampler)


def run(stage: int, out) -> dict:
    lit = LitLora(out, stage)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         strategy=zero_strategy.ZeroStrategy(stage=stage, param_persistence_threshold=0))
    trainer.fit(lit, loader())
    res = dict(during_fit=lit.during_fit, global_steps=trainer.global_step, batches_as_planned=lit.batches_as_planned)
    ref = reference(STEPS, WORLD)
    trainer.strategy.teardown()  # every rank: release the engine, the model is whole again
    if trainer.is_global_zero:  # rank 0 alone may save it now
        after = after_training(lit.model, ref, out, f"lightning-after-fit-s{stage}", 0,
                               lambda m, d: m.save_pretrained(d))
        res["after_fit"] = after
    return res


def main() -> None:
    args, out = start()
    finish(out, {f"stage{s}": run(s, out) for s in (1, 2, 3)})


if __name__ == "__main__":
    main()
