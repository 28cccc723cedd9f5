"""PEFT LoRA trained by ``ZeroTrainer`` at stages 1-3 under ``accelerate launch``, beside the stock
``Trainer`` (DDP) on the same data: the reference, as a single process on the global batch would be.

Saved the HF way: ``trainer.save_model(d)`` (every rank calls it; the adapter is written
once), and the merged model with ``save_pretrained(d, is_main_process=...)``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from _peft_models import Rows, after_training, lora, tiny_llama
from _worker import finish
from zero_strategy.transformers import ZeroTrainer  # before TrainingArguments (see its module note)

from transformers import Trainer, TrainingArguments  # noqa: E402

STEPS, ROWS = 3, 2




def arguments(output_dir: Path) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=ROWS, max_steps=STEPS, save_strategy="no",
        learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.01, report_to=[], seed=0, data_seed=0,
        disable_tqdm=True, dataloader_num_workers=0, logging_steps=1)


_STOCK: dict = {}


def stock_run(out: Path):
    """The stock Trainer's run, the reference: the same for every stage (nothing in it depends on the
    stage), so it trains once, after the first stage's ZeroTrainer, and each stage gets a fresh PEFT model
    holding its trained weights (the PEFT calls merge the reference in place) and its logged losses."""
    if not _STOCK:
        stock = Trainer(model=lora(tiny_llama()), args=arguments(out / "stock"), train_dataset=Rows(STEPS))
        stock.train()
        trained = stock.accelerator.unwrap_model(stock.model)
        _STOCK.update(state={k: v.detach().clone() for k, v in trained.state_dict().items()},
                      losses=[h["loss"] for h in stock.state.log_history if "loss" in h])
    ref = lora(tiny_llama())
    ref.load_state_dict(_STOCK["state"])
    return ref, _STOCK["losses"]


def run(stage: int, out: Path) -> dict:
    trainer = ZeroTrainer(model=lora(tiny_llama()), args=arguments(out / f"zero-s{stage}"), train_dataset=Rows(STEPS),
                          zero_config={"stage": stage, "param_persistence_threshold": 0})
    trainer.train()
    ref, stock_losses = stock_run(out)
    rank = trainer.args.process_index

    def save(m, directory):
        if m is trainer.model:
            trainer.save_model(str(directory))
        else:
            m.save_pretrained(directory, is_main_process=trainer.is_world_process_zero())
        trainer.accelerator.wait_for_everyone()

    res = after_training(trainer.model, ref, out, f"trainer-s{stage}", rank, save)
    res["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    res["stock_losses"] = stock_losses
    return res


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    finish(out, {f"stage{s}": run(s, out) for s in (1, 2, 3)})


if __name__ == "__main__":
    main()
