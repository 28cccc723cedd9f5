"""What Lightning users do after ``trainer.fit(model)``, written as Lightning's docs write it.

For each case (args["cases"]: name, strategy as in lightning_trainer.make_strategy, precision):

1. ``trainer.fit(model, train, val)``; then ``trainer.validate``, ``trainer.test``,
   ``trainer.predict`` and ``trainer.save_checkpoint("final.ckpt")`` on the same Trainer;
2. a second ``fit`` on that Trainer with ``trainer.fit_loop.max_epochs`` raised (continues);
3. a new Trainer resumes from ``final.ckpt`` (``fit(ckpt_path=...)``) and another one
   validates it (``validate(ckpt_path=...)``);
4. ``trainer.strategy.teardown()``, then rank 0 alone reads ``model.state_dict()``;
5. a third fit, then ``trainer.validate`` of another module.

Rank 0 saves the weights of 1, 2, 3 and 4 as <save_dir>/<name>-<step>.pt; every rank
reports metrics, predictions and losses.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from _worker import finish, run_named_cases, start
from _models import SEQ, VOCAB, loss_fn
from lightning_trainer import LitLM, make_strategy

import zero_strategy  # noqa: F401 - registers the presets
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset


class LitEval(LitLM):
    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        self.log("val_loss", loss_fn(self(tokens), targets), sync_dist=True)

    def test_step(self, batch, batch_idx):
        tokens, targets = batch
        self.log("test_loss", loss_fn(self(tokens), targets), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).float()


def data(seed: int, n: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return DataLoader(TensorDataset(tokens, targets), batch_size=4, shuffle=False)


def trainer_for(strategy, world: int, epochs: int, precision: str = "32-true") -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=world, strategy=make_strategy(strategy), max_epochs=epochs,
                      precision=precision,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0)


def save_weights(model, path: str) -> None:
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}  # every rank (stage 3)
    if dist.get_rank() == 0:
        torch.save(state, path)


def run_case(case: dict, world: int) -> dict:
    name, out = case["name"], case["save_dir"]
    ckpt = os.path.join(out, f"{name}-final.ckpt")
    train, val = data(7), data(8)
    model = LitEval()
    precision = case.get("precision", "32-true")
    trainer = trainer_for(case["strategy"], world, epochs=1, precision=precision)
    trainer.fit(model, train, val)
    report = {"fit_losses": list(model.losses)}
    report["validate"] = trainer.validate(model, val, verbose=False)
    report["test"] = trainer.test(model, val, verbose=False)
    report["predict"] = [p.tolist() for p in trainer.predict(model, val)]
    trainer.save_checkpoint(ckpt)
    save_weights(model, os.path.join(out, f"{name}-fit.pt"))

    trainer.fit_loop.max_epochs = 2  # the second fit continues where the first ended
    model.losses.clear()
    trainer.fit(model, train)
    report.update(second_fit_losses=list(model.losses), second_fit_step=trainer.global_step)
    save_weights(model, os.path.join(out, f"{name}-second_fit.pt"))

    resumed = LitEval()
    resumer = trainer_for(case["strategy"], world, epochs=2, precision=precision)
    resumer.fit(resumed, train, ckpt_path=ckpt)
    report.update(resumed_losses=list(resumed.losses), resumed_step=resumer.global_step)
    save_weights(resumed, os.path.join(out, f"{name}-resumed.pt"))
    report["validate_ckpt"] = trainer_for(case["strategy"], world, epochs=1, precision=precision).validate(
        LitEval(), val, ckpt_path=ckpt, verbose=False)

    if zero_strategy.is_set_up(model):  # the fp32 masters, to compare the released weights with
        masters = zero_strategy.full_state_dict(model)
        if dist.get_rank() == 0:
            torch.save(masters, os.path.join(out, f"{name}-masters.pt"))
    trainer.strategy.teardown()  # release the engine: a plain module on every rank
    report["dtypes_after_release"] = sorted({str(p.dtype) for p in model.parameters()})
    report["set_up_after_release"] = zero_strategy.is_set_up(model)
    if dist.get_rank() == 0:  # the rank-0-only idiom needs no other rank now
        torch.save({k: v.float() for k, v in model.state_dict().items()}, os.path.join(out, f"{name}-released.pt"))

    trainer.fit_loop.max_epochs = 3
    trainer.fit(model, train)  # set up again ...
    trainer.validate(LitEval(), val, verbose=False)  # ... and released when the Trainer moves on to another module
    report["set_up_after_other_module"] = zero_strategy.is_set_up(model)
    return report


def main() -> None:
    args, out = start()
    world = dist.get_world_size()
    finish(out, run_named_cases(args["cases"], lambda case: run_case(case, world), barrier=True))


if __name__ == "__main__":
    main()
