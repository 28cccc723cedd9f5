"""A Lightning ``DeepSpeedStrategy`` checkpoint directory resumed by ``Trainer(strategy="zero2"/"zero3").fit(ckpt_path=...)``.

Lightning's DeepSpeedStrategy needs CUDA (its ``setup_environment`` refuses any other accelerator),
so the directory is made the way it makes one (lightning/pytorch/strategies/deepspeed.py):
``deepspeed.initialize`` over the LightningModule itself (so DeepSpeed names the parameters as the
LightningModule does), the LR scheduler stepped by Lightning (DeepSpeedStrategy takes it out of
the engine and steps it as any scheduler), and at the save
``engine.save_checkpoint(dir, client_state=<Lightning's checkpoint dict less "state_dict" and
"optimizer_states">, tag="checkpoint")``. Lightning's checkpoint dict is a real one: a DDP
``Trainer.fit`` of the same module over the same batches to SAVE_AT steps, then
``trainer._checkpoint_connector.dump_checkpoint()``, the dict a ``trainer.save_checkpoint`` hands
to its strategy.

args["mode"] == "deepspeed": for each case {name, stage, dir}, the run above; DeepSpeed trains on to
END and rank 0 writes ``dir/reference.pt``: the global loss of each step after the save, the fp32
weights at the end, each group's lr at the end.
args["mode"] == "ours": for each case {name, strategy, dir}, ``Trainer(strategy=...).fit(module,
ckpt_path=dir)`` with ``max_steps=END``; reports the global losses of the steps it trained, the
global step it started from and ended at, the lr of each group at the end; rank 0 saves
the final fp32 weights to ``<out>/<name>.pt``.

Step k trains on the global batch of k (GLOBAL samples; rank r of N takes its GLOBAL/N slice, so the
averaged gradient is the same at any world size), chosen by ``trainer.global_step`` in
``training_step``: where Lightning's loops restart the data after a resume is Lightning's own
business (from a checkpoint of an epoch's end it iterates the interrupted epoch's loader once more),
and the same for any strategy; the comparison is of the steps.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import deepspeed_checkpoint as ds_worker  # noqa: F401 - sets DeepSpeed's CPU accelerator and op cache first
from _models import TinyLM, loss_fn, param_groups
from _worker import finish, run_cases, start

import zero_strategy  # noqa: F401 - registers the presets
import lightning.pytorch as pl
from torch.utils.data import DataLoader

EPOCH, END = 3, 6
SAVE_AT = EPOCH


def rank_batch(step: int):
    """This rank's slice of the global batch of ``step``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = ds_worker.global_batch(step)
    per = ds_worker.GLOBAL // world
    return tokens[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per]


def global_loss(loss: torch.Tensor) -> float:
    total = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


class LitLM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4321)
        self.model = TinyLM(layers=2)
        with torch.no_grad():  # a frozen parameter unlike a fresh model's: the resume must load it
            self.model.frozen_mix.mul_(-2.0)
        self.losses: list[float] = []

    def forward(self, tokens):
        return self.model(tokens)

    def training_step(self, batch, batch_idx):
        tokens, targets = rank_batch(self.trainer.global_step)
        loss = loss_fn(self(tokens), targets)
        self.losses.append(global_loss(loss))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(param_groups(self.model), betas=(0.9, 0.95))
        sched = ds_worker.scheduler(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader() -> DataLoader:
    """One epoch of EPOCH steps; what each step trains on is chosen in ``training_step``."""
    return DataLoader(list(range(EPOCH)), batch_size=None, shuffle=False)


def trainer(strategy, max_steps: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, max_steps=max_steps,
                      use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def lightning_checkpoint_dict() -> dict:
    """What Lightning hands its strategy's ``save_checkpoint`` at the end of this run's first epoch
    (step SAVE_AT), where ``ModelCheckpoint`` saves: the dict of ``dump_checkpoint`` there."""
    dumped = {}

    class Dump(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            dumped.update(trainer._checkpoint_connector.dump_checkpoint(weights_only=False))

    t = trainer("ddp", SAVE_AT)
    t.callbacks.append(Dump())
    t.fit(LitLM(), loader())
    return dumped


def run_deepspeed(case: dict) -> dict:
    import importlib

    import deepspeed

    # See [Note: DeepSpeed's compiled ops in the tests] in deepspeed_checkpoint.py
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    client_state = {k: v for k, v in lightning_checkpoint_dict().items()
                    if k not in ("state_dict", "optimizer_states")}  # as DeepSpeedStrategy.save_checkpoint
    module = LitLM()
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    config = {"train_micro_batch_size_per_gpu": ds_worker.GLOBAL // dist.get_world_size(),
              "gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": case["stage"]},
              "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)

    def step(k: int) -> float:
        tokens, targets = rank_batch(k)
        loss = loss_fn(engine(tokens), targets)
        engine.backward(loss)
        engine.step()
        sched.step()  # Lightning's, after the optimizer step (DeepSpeedStrategy keeps it out of the engine)
        return global_loss(loss)

    for k in range(SAVE_AT):
        step(k)
    engine.save_checkpoint(case["dir"], client_state=client_state, tag="checkpoint")
    losses = [step(k) for k in range(SAVE_AT, END)]
    final = ds_worker.deepspeed_fp32_weights(engine)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "final": final, "lr": [pg["lr"] for pg in engine.optimizer.param_groups],
                    "client_state": {k: client_state[k] for k in ("epoch", "global_step")}},
                   os.path.join(case["dir"], "reference.pt"))
    dist.barrier()
    return {"name": case["name"]}


def run_ours(case: dict, out) -> dict:
    module = LitLM()
    started = {}

    class Started(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            started.update(global_step=trainer.global_step)

    t = trainer(case["strategy"], END)
    t.callbacks.append(Started())
    t.fit(module, loader(), ckpt_path=case["dir"])
    final = zero_strategy.full_state_dict(module, dtype=None)
    if dist.get_rank() == 0:
        torch.save({"final": final}, out / f"{case['name']}.pt")
    return {"name": case["name"], "losses": module.losses, "started": started,
            "ended": {"global_step": t.global_step},
            "lr": [pg["lr"] for pg in t.optimizers[0].param_groups]}


def main() -> None:
    args, out = start()
    if args["mode"] == "deepspeed":
        results = run_cases(args["cases"], run_deepspeed, key="name")
    else:
        results = run_cases(args["cases"], lambda case: run_ours(case, out), key="name")
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
