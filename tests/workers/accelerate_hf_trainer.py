"""A tiny Llama trained by ``ZeroTrainer`` under ``accelerate launch``, then resumed from a checkpoint.

Run A trains 4 optimizer steps under ``save_preset``, saving checkpoint-2 and checkpoint-4.
Run B is a fresh model and ZeroTrainer under ``load_preset`` that resumes from
checkpoint-2 and must end on run A's weights. The main process also reloads
checkpoint-4 with ``from_pretrained`` and compares it with run A's weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from _compare import rel_diff
from _worker import finish
from zero_strategy.transformers import ZeroTrainer  # before TrainingArguments (see its module note)

from transformers import LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import zero_strategy as zs  # noqa: E402
from _tiny_trainer_data import Tokens, make_model  # noqa: E402



def arguments(output_dir: Path, save: bool = True) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
        save_strategy="steps" if save else "no", save_steps=2, logging_steps=1, learning_rate=3e-3, lr_scheduler_type="linear",
        max_grad_norm=0.5, report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    report: dict = {}

    model_a = make_model(seed=0)
    trainer_a = ZeroTrainer(model=model_a, args=arguments(out / "run_a"), train_dataset=Tokens(),
                            zero_config=args["save_preset"])
    trainer_a.train()
    from zero_strategy.accelerate import ZeroAccelerator
    report["accelerator"] = [c.__name__ for c in type(trainer_a.accelerator).__mro__ if c is ZeroAccelerator]
    report["num_processes"] = trainer_a.accelerator.num_processes
    report["stage_a"] = trainer_a.accelerator.zero_config.stage
    report["model_is_users"] = trainer_a.model is model_a
    report["losses_a"] = [h["loss"] for h in trainer_a.state.log_history if "loss" in h]
    report["grad_norms_a"] = [h["grad_norm"] for h in trainer_a.state.log_history if "grad_norm" in h]
    final_a = zs.full_state_dict(model_a)
    ckpt2 = out / "run_a" / "checkpoint-2"
    report["checkpoint_files"] = sorted(os.listdir(ckpt2))
    report["zero_files"] = sorted(os.listdir(ckpt2 / "zero_checkpoint"))
    report["zero_files_last"] = sorted(os.listdir(out / "run_a" / "checkpoint-4" / "zero_checkpoint"))
    report["background_saves"] = zs.api._engine_of(model_a).background_save.started

    model_b = make_model(seed=99)  # other weights: the resume must replace them
    trainer_b = ZeroTrainer(model=model_b, args=arguments(out / "run_b"), train_dataset=Tokens(),
                            zero_config=args["load_preset"])
    trainer_b.train(resume_from_checkpoint=str(ckpt2))
    report["stage_b"] = trainer_b.accelerator.zero_config.stage
    report["losses_b"] = [h["loss"] for h in trainer_b.state.log_history if "loss" in h]
    report["resume_rel"] = rel_diff(zs.full_state_dict(model_b), final_a)

    # ground truth: the stock Trainer (DDP) on the same initial weights and data
    model_ref = make_model(seed=0)
    trainer_ref = Trainer(model=model_ref, args=arguments(out / "run_ref", save=False), train_dataset=Tokens())
    trainer_ref.train()
    report["ref_model_type"] = type(trainer_ref.model_wrapped).__name__
    report["grad_norms_ref"] = [h["grad_norm"] for h in trainer_ref.state.log_history if "grad_norm" in h]
    report["ddp_rel"] = rel_diff(final_a, {k: v.detach() for k, v in model_ref.state_dict().items()})

    if trainer_a.accelerator.is_main_process:
        reloaded = LlamaForCausalLM.from_pretrained(out / "run_a" / "checkpoint-4")
        report["from_pretrained_rel"] = rel_diff(reloaded.state_dict(), final_a)

    finish(out, report)


if __name__ == "__main__":
    main()
