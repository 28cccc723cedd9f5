"""A Trainer subclass keeping its own state in ``_save/_load_optimizer_and_scheduler``, resumed via ``zero_trainer``.

``TrainerWithExtraState`` is written the way a trainer author writes one (GRPOTrainer restores its
adaptive-entropy state the same way): it counts the micro-batches it trained and the sum of
their token ids over all ranks (exact, different for every batch, the same on every rank, as
the main process alone writes it), saves both to ``extra_state.json`` after ``super()._save_optimizer_and_scheduler``
and reads them back after ``super()._load_optimizer_and_scheduler``.

Run A: ``zero_trainer(TrainerWithExtraState)`` at zero3, 4 optimizer steps, checkpoints at 2 and 4.
Before run B, a decoy ``optimizer.pt`` is put into checkpoint-2, as a stock Trainer would have
written it; the stock load must not read it (it would load one rank's state into every rank).
Run B: a fresh model and trainer resume from checkpoint-2 and finish; reported: what the
subclass's load restored, the state at the end of both runs, both runs' final weights and losses.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from _worker import finish, worst_rel_diff
from zero_strategy.transformers import zero_trainer  # before TrainingArguments (see its module note)

from transformers import Trainer, TrainingArguments  # noqa: E402

import zero_strategy as zs  # noqa: E402
from _tiny_trainer_data import Tokens, make_model  # noqa: E402

EXTRA = "extra_state.json"


class TrainerWithExtraState(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batches = 0
        self.tokens_seen = 0
        self.restored: dict | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.micro_batches += 1
        self.tokens_seen += int(self.accelerator.gather(inputs["input_ids"]).sum())  # over all ranks: one state
        return loss

    def _save_optimizer_and_scheduler(self, output_dir):
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            with open(os.path.join(output_dir, EXTRA), "w") as f:
                json.dump({"micro_batches": self.micro_batches, "tokens_seen": self.tokens_seen}, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and os.path.exists(os.path.join(checkpoint, EXTRA)):
            with open(os.path.join(checkpoint, EXTRA)) as f:
                self.restored = json.load(f)
            self.micro_batches, self.tokens_seen = self.restored["micro_batches"], self.restored["tokens_seen"]


def arguments(output_dir: Path) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
        save_strategy="steps", save_steps=2, logging_steps=1, learning_rate=3e-3, lr_scheduler_type="linear",
        report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    cls = zero_trainer(TrainerWithExtraState)
    report: dict = {"mro": [c.__name__ for c in cls.__mro__]}

    trainer_a = cls(model=make_model(0), args=arguments(out / "run_a"), train_dataset=Tokens(),
                    zero_config={"stage": 3, "param_persistence_threshold": 0})
    trainer_a.train()
    ckpt2 = out / "run_a" / "checkpoint-2"
    report["checkpoint_files"] = sorted(os.listdir(ckpt2))
    report["saved_at_2"] = json.loads((ckpt2 / EXTRA).read_text())
    report["end_a"] = {"micro_batches": trainer_a.micro_batches, "tokens_seen": trainer_a.tokens_seen}
    report["losses_a"] = [h["loss"] for h in trainer_a.state.log_history if "loss" in h]
    final_a = zs.full_state_dict(trainer_a.model)
    trainer_a.accelerator.wait_for_everyone()
    if trainer_a.args.should_save:  # what a stock Trainer would have written: rank 0's view of the optimizer
        torch.save({"state": {}, "param_groups": [{"lr": 123.0, "params": [0]}]}, ckpt2 / "optimizer.pt")
    trainer_a.accelerator.wait_for_everyone()

    trainer_b = cls(model=make_model(99), args=arguments(out / "run_b"), train_dataset=Tokens(),
                    zero_config={"stage": 3, "param_persistence_threshold": 0})
    trainer_b.train(resume_from_checkpoint=str(ckpt2))
    report["restored"] = trainer_b.restored
    report["end_b"] = {"micro_batches": trainer_b.micro_batches, "tokens_seen": trainer_b.tokens_seen}
    report["losses_b"] = [h["loss"] for h in trainer_b.state.log_history if "loss" in h]
    report["resume_rel"], _ = worst_rel_diff(zs.full_state_dict(trainer_b.model), final_a)
    finish(out, report)


if __name__ == "__main__":
    main()
