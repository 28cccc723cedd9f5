"""``ZeroTrainer(...).train(resume_from_checkpoint=checkpoint-N)`` on the checkpoint-N of a DeepSpeed run,
under ``accelerate launch`` (2 processes).

args: ``checkpoint`` (the checkpoint-3 directory, see tests/test_deepspeed_checkpoint_import.py),
``preset``. The model is tests/workers/deepspeed_checkpoint.py's TinyLM (same names, same global
batches: rank r of 2 takes the r-th half of each global batch, as the sequential sampler and
Accelerate's batch sharding hand them out) with the Trainer's ``{"loss": ...}`` output; the
optimizer is that run's AdamW over its two param groups (``optimizers=(opt, None)``); the Trainer
builds its "constant" scheduler. It trains on to step END; rank 0 writes the fp32 weights and the
frozen parameter to ``<out>/resumed.pt``; each rank reports the logged losses and the step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from _worker import finish
from zero_strategy.transformers import ZeroTrainer  # before TrainingArguments (see its module note)

from transformers import TrainingArguments  # noqa: E402

import zero_strategy as zs  # noqa: E402
from _models import TinyLM, loss_fn, param_groups  # noqa: E402
from deepspeed_checkpoint import END, GLOBAL, global_batch  # noqa: E402


class TrainerLM(TinyLM):
    """TinyLM as the Trainer calls it: keyword inputs, the loss in the output."""

    def forward(self, input_ids, labels=None):
        return {"loss": loss_fn(super().forward(input_ids), labels)}


class GlobalBatches(torch.utils.data.Dataset):
    """Steps 0..END-1's global batches, end to end: example i is row i % GLOBAL of batch i // GLOBAL."""

    def __len__(self):
        return END * GLOBAL

    def __getitem__(self, i):
        tokens, targets = global_batch(i // GLOBAL)
        return {"input_ids": tokens[i % GLOBAL], "labels": targets[i % GLOBAL]}


class SequentialZeroTrainer(ZeroTrainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    torch.manual_seed(99)  # other weights than the DeepSpeed run's: the resume must replace them
    model = TrainerLM(layers=2)
    opt = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))
    targs = TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=GLOBAL // 2, max_steps=END, save_strategy="no",
        logging_steps=1, lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], seed=0,
        disable_tqdm=True, dataloader_num_workers=0)
    trainer = SequentialZeroTrainer(model=model, args=targs, train_dataset=GlobalBatches(), optimizers=(opt, None),
                                    zero_config=args["preset"])
    trainer.train(resume_from_checkpoint=args["checkpoint"])
    weights = zs.full_state_dict(model, dtype=None)
    if trainer.accelerator.is_main_process:
        torch.save({"final": {k: v for k, v in weights.items() if k != "frozen_mix"}, "frozen": weights["frozen_mix"]},
                   out / "resumed.pt")
    finish(out, {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                 "global_step": trainer.state.global_step,
                 "lr": [pg["lr"] for pg in trainer.optimizer.param_groups]})


if __name__ == "__main__":
    main()
