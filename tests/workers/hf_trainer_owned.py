"""The HF Trainer given an optimizer that needs whole tensors, under ``accelerate launch`` (2 CPU processes).

Two idioms, each against the stock Trainer (DDP) with the same optimizer on the same weights and data:
``optimizers=(torch.optim.Adafactor(...), None)`` under zero2, and transformers' own
``optim="adafactor"`` (transformers.optimization.Adafactor) under zero3. Both step whole parameters
(the ownership layout); clipping (max_grad_norm) and the linear schedule are on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from _compare import rel_diff
from _worker import finish
from zero_strategy.transformers import ZeroTrainer  # before TrainingArguments (see its module note)

from transformers import Trainer, TrainingArguments  # noqa: E402

import zero_strategy as zs  # noqa: E402
from _tiny_trainer_data import Tokens, make_model  # noqa: E402


def arguments(output_dir: Path, **extra) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=4, save_strategy="no",
        logging_steps=1, learning_rate=1e-2, lr_scheduler_type="linear", max_grad_norm=0.5, report_to=[], seed=0,
        data_seed=0, disable_tqdm=True, dataloader_num_workers=0, **extra)


def run(out: Path, name: str, zero_config: str | None, **how) -> tuple[dict, list, object]:
    model = make_model(seed=0)
    extra = {"optim": how["optim"]} if "optim" in how else {}
    kwargs = {"optimizers": (torch.optim.Adafactor(model.parameters(), lr=1e-2), None)} if "optimizers" in how else {}
    cls = ZeroTrainer if zero_config else Trainer
    if zero_config:
        kwargs["zero_config"] = zero_config
    trainer = cls(model=model, args=arguments(out / name, **extra), train_dataset=Tokens(), **kwargs)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = zs.full_state_dict(model) if zero_config else {k: v.detach() for k, v in model.state_dict().items()}
    owned = []
    if zero_config:  # the optimizer ZeroTrainer re-homed, and how many groups it steps whole
        engine = zs.api._engine_of(model)
        owned = [next(f"{type(z.optimizer).__module__}.{type(z.optimizer).__name__}" for z in engine.optimizers()),
                 sum(1 for g in engine.groups if g.owned)]
    return weights, losses, owned


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    report: dict = {}
    for name, preset, how in (("optimizers_arg", "zero2", {"optimizers": True}),
                              ("optim_adafactor", "zero3", {"optim": "adafactor"})):
        zero, zero_losses, owned = run(out, f"{name}_zero", preset, **how)
        ref, ref_losses, _ = run(out, f"{name}_ref", None, **how)
        report[name] = dict(rel=rel_diff(zero, ref), losses=zero_losses, ref_losses=ref_losses, owned=owned)
    finish(out, report)


if __name__ == "__main__":
    main()
