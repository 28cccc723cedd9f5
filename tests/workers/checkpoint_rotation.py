"""Rotation of old checkpoints beside an asynchronous save (tests/test_checkpoint_rotation.py), one rank.

``front_end="hf"``: ``ZeroTrainer`` with ``save_strategy="steps", save_steps=1, save_total_limit=1``
and ``async_save``; ``front_end="accelerate"``: ``ZeroAccelerator.save_state`` with
``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=1)``; ``front_end="lightning"``:
``ModelCheckpoint(save_top_k=1, every_n_train_steps=1)`` with ``ZeroStrategy(async_save=True)``. Every write is held a
moment, so the rotation comes while the save is still writing. Each case runs in a directory of
its own; its ``fail_at`` names the checkpoint whose write fails with ENOSPC (None: none fails). The
report lists the checkpoints left and whether the one before the failure still resumes.
"""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import torch

from _worker import finish, run_cases, start
from zero_strategy.transformers import ZeroTrainer  # before TrainingArguments (see its module note)

from transformers import TrainerCallback, TrainingArguments  # noqa: E402

import zero_strategy as zs  # noqa: E402
from zero_strategy.checkpoint import _save  # noqa: E402
from _tiny_trainer_data import Tokens, make_model  # noqa: E402

CONFIG = {"preset": "zero2", "async_save": True}


def slow_writes(fail_at: str | None) -> None:
    """Each write waits 0.2 s; the save of ``fail_at`` (its thread is named by its path) then fails."""
    def hook(item):
        time.sleep(0.2)
        if fail_at is not None and f"{fail_at}/" in threading.current_thread().name + "/":
            raise OSError(errno.ENOSPC, "No space left on device")
    _save._before_background_write = hook


def listed(root: Path, prefix: str) -> list[str]:
    return sorted(p.name for p in root.glob(f"{prefix}*") if p.is_dir())


def run_hf(out: Path, fail_at: str | None) -> dict:
    def arguments(max_steps: int) -> TrainingArguments:
        return TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=max_steps,
                                 save_strategy="steps", save_steps=1, save_total_limit=1, learning_rate=3e-3,
                                 report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)

    slow_writes(fail_at)
    report: dict = {}
    try:
        ZeroTrainer(model=make_model(seed=0), args=arguments(3), train_dataset=Tokens(), zero_config=CONFIG).train()
    except zs.CheckpointError as err:
        report["save_error"] = str(err)
    _save._before_background_write = None
    report["left"] = listed(out, "checkpoint-")
    if fail_at is not None:  # the last good checkpoint resumes, as users resume
        resumed = ZeroTrainer(model=make_model(seed=1), args=arguments(3), train_dataset=Tokens(), zero_config=CONFIG)
        steps: list[int] = []
        resumed.add_callback(type("Steps", (TrainerCallback,), {
            "on_step_end": lambda self, args, state, control, **kw: steps.append(state.global_step)}))
        resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
        report["resumed_steps"] = steps
    return report


def run_accelerate(out: Path, fail_at: str | None) -> dict:
    from accelerate.utils import ProjectConfiguration

    from zero_strategy.accelerate import ZeroAccelerator

    def prepared():
        acc = ZeroAccelerator({**CONFIG}, project_config=ProjectConfiguration(
            project_dir=str(out), automatic_checkpoint_naming=True, total_limit=1))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        return acc, model, opt

    acc, model, opt = prepared()
    slow_writes(fail_at)
    report: dict = {}
    try:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            acc.save_state()
        zs.checkpoint.wait_for_save(model)
    except zs.CheckpointError as err:
        report["save_error"] = str(err)
    _save._before_background_write = None
    report["left"] = listed(out / "checkpoints", "checkpoint_")
    if fail_at is not None:  # the last good checkpoint loads, as users load it
        acc.load_state(str(out / "checkpoints" / "checkpoint_0"))
        report["loaded"] = True
    return report


def run_lightning(out: Path, fail_at: str | None) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 2)), batch_size=4)

    def trainer() -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=1, strategy=zs.ZeroStrategy(stage=2, async_save=True),
                          max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          callbacks=[ModelCheckpoint(dirpath=out, save_top_k=1, every_n_train_steps=1)])

    slow_writes(fail_at)
    report: dict = {}
    try:
        trainer().fit(Regression(), data)
    except zs.CheckpointError as err:
        report["save_error"] = str(err)
    _save._before_background_write = None
    report["left"] = sorted(p.name for p in out.glob("*.ckpt"))
    if fail_at is not None:  # the last good checkpoint resumes, as users resume
        resumed = trainer()
        resumed.fit(Regression(), data, ckpt_path=str(out / "epoch=0-step=2.ckpt"))
        report["resumed_global_step"] = resumed.global_step
    return report


def main() -> None:
    args, out = start()
    run = {"hf": run_hf, "accelerate": run_accelerate, "lightning": run_lightning}
    finish(out, {"results": run_cases(args["cases"], lambda case: {
        "case": case["case"], **run[case["front_end"]](out / case["case"], case["fail_at"])})})


if __name__ == "__main__":
    main()
