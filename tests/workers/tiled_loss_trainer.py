"""``ZeroTrainer`` with ``tiled_loss`` against the stock Trainer (tests/test_tiled_loss_trainer.py).

The Trainer's own loop (gradient accumulation, so it passes ``num_items_in_batch``) on a tiny
untied Llama under zero3 with ``tiled_loss``, and the stock ``Trainer`` on the same weights and data.
A forward hook on the head records what it returned: a scalar (the tiled loss) or logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from _worker import finish, start
from zero_strategy.transformers import ZeroTrainer  # before TrainingArguments (see its module note)

from transformers import Trainer, TrainingArguments  # noqa: E402

import zero_strategy as zs  # noqa: E402
from _tiny_trainer_data import Tokens, make_model  # noqa: E402


def arguments(output_dir: Path) -> TrainingArguments:
    return TrainingArguments(output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=3, save_strategy="no", logging_steps=1, learning_rate=3e-3, report_to=[],
                             seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)


def main() -> None:
    args, out = start()
    model = make_model(seed=0)
    head_outputs: list[int] = []
    model.lm_head.register_forward_hook(lambda m, i, o: head_outputs.append(o.dim()))
    trainer = ZeroTrainer(model=model, args=arguments(out / "tiled"), train_dataset=Tokens(),
                          zero_config={"preset": "zero3", "param_persistence_threshold": 0, "tiled_loss": 4})
    trainer.train()
    trained = zs.full_state_dict(model)
    ref = make_model(seed=0)
    stock = Trainer(model=ref, args=arguments(out / "stock"), train_dataset=Tokens())
    stock.train()
    report = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "ref_losses": [h["loss"] for h in stock.state.log_history if "loss" in h],
        "weight_rel_diff": max(((trained[k] - v).abs().max() / v.abs().max()).item()
                               for k, v in ref.state_dict().items()),
        "head_output_dims": sorted(set(head_outputs)), "head_calls": len(head_outputs),
    }
    finish(out, report)


if __name__ == "__main__":
    main()
