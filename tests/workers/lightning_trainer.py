"""Trainer scenarios, several per process start (a 2-rank Trainer.fit costs seconds here).

args["cases"]: list of dicts with
  name, strategy ("ddp" or a preset name, or {"stage": .., ...} for ZeroStrategy(**dict)),
  precision, accumulate, clip (gradient_clip_val), clip_algorithm, epochs, batch (per rank), module ("lm" | "gan" |
  "meta" | "muon"),
  ckpt_dir (ModelCheckpoint there: top-1 by train_loss + last, every epoch),
  resume (ckpt_path for fit),
  save_weights_only (path: trainer.save_checkpoint(path, weights_only=True) after fit: a plain .ckpt),
  summary (report ModelSummary counts), callbacks ("swa"),
  every_rank_saves (each rank also saves its final weights to <save_dir>/<name>.rank<r>.pt).
Each case reports: losses, errors, checkpoint files; rank 0 torch.saves the final weights
to <save_dir>/<name>.pt.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from _worker import finish, run_named_cases, start
from _models import SEQ, VOCAB, TinyLM, loss_fn, param_groups

import zero_strategy  # noqa: F401 - registers the presets
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

STEPS_PER_EPOCH = 2


class LitLM(pl.LightningModule):
    def __init__(self, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(1234)
        self.model = TinyLM(layers=2)
        self.losses: list[float] = []

    def forward(self, tokens):
        return self.model(tokens)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = loss_fn(self(tokens), targets)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(param_groups(self.model, lr=self.hparams.lr), betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Generator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 12))

    def forward(self, z):
        return self.net(z)


class Discriminator(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


class LitGAN(pl.LightningModule):
    """Two optimizers (Adam for G, SGD with momentum for D), manual optimization."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(99)
        self.generator = Generator()
        self.discriminator = Discriminator()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        real = torch.cat(batch, dim=1).float()[:, :12] / VOCAB
        opt_g, opt_d = self.optimizers()
        g = torch.Generator().manual_seed(500 + 10 * self.global_step + self.global_rank)
        z = torch.randn(real.shape[0], 8, generator=g)
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = bce(self.discriminator(fake).float(), torch.ones(real.shape[0], 1))
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_real = self.discriminator(real).float()
        d_fake = self.discriminator(self.generator(z).detach()).float()
        d_loss = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.losses.append(float(g_loss) + float(d_loss))

    def configure_optimizers(self):
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-2),
                torch.optim.SGD(self.discriminator.parameters(), lr=5e-2, momentum=0.9))


class LitMuon(pl.LightningModule):
    """torch's Muon recipe in Lightning's idiom: configure_optimizers returns [Muon, AdamW] (Muon for
    the hidden 2-D matrices, AdamW for embeddings, norms and biases), manual optimization."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(1234)
        self.model = TinyLM(layers=2)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = loss_fn(self.model(tokens), targets)
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()
            opt.zero_grad()
        self.losses.append(float(loss))

    def configure_optimizers(self):
        hidden = [p for n, p in self.model.named_parameters() if p.requires_grad and p.ndim == 2 and "layers." in n]
        rest = [p for n, p in self.model.named_parameters() if p.requires_grad and not (p.ndim == 2 and "layers." in n)]
        return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]


class _SeededInit:
    """``reset_parameters`` from the module's own seed plus 1000 * rank.

    The values then do not depend on when or in what order modules are initialized
    (eagerly in configure_model under DDP, unit by unit at setup under stage 3), and the
    ranks agree only through a broadcast of rank 0's values (DDP's when it wraps the
    model, setup's after materializing each unit)."""

    def reset_parameters(self):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.init_seed + 1000 * dist.get_rank())
            super().reset_parameters()


class SeededLinear(_SeededInit, torch.nn.Linear):
    def __init__(self, seed: int, *args):
        object.__setattr__(self, "init_seed", seed)  # Linear.__init__ calls reset_parameters
        super().__init__(*args)


class SeededEmbedding(_SeededInit, torch.nn.Embedding):
    def __init__(self, seed: int, *args):
        object.__setattr__(self, "init_seed", seed)
        super().__init__(*args)


class LitMeta(pl.LightningModule):
    """Built in configure_model: on the meta device under stage 3, materialized unit by unit by setup."""

    def __init__(self, widths=(16, 32, 32, 16)):
        super().__init__()
        self.widths = widths
        self.layers = None
        self.losses: list[float] = []

    def configure_model(self):
        if self.layers is not None:
            return
        self.report_meta = any(p.is_meta for p in torch.nn.Linear(2, 2).parameters())
        self.embed = SeededEmbedding(1, VOCAB, self.widths[0])
        self.layers = torch.nn.ModuleList(SeededLinear(10 + i, a, b)
                                          for i, (a, b) in enumerate(zip(self.widths, self.widths[1:])))
        self.head = SeededLinear(2, self.widths[-1], VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)

    def training_step(self, batch, batch_idx):
        loss = loss_fn(self(batch[0]), batch[1])
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(world: int, batch: int) -> DataLoader:
    n = STEPS_PER_EPOCH * batch * world
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return DataLoader(TensorDataset(tokens, targets), batch_size=batch, shuffle=False)


def make_strategy(spec):
    if isinstance(spec, dict):
        return zero_strategy.ZeroStrategy(**spec)
    return spec


def run_case(case: dict, out, world: int) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, StochasticWeightAveraging

    module = {"gan": LitGAN, "meta": LitMeta, "muon": LitMuon}.get(case.get("module"), LitLM)()
    callbacks = []
    if case.get("ckpt_dir"):
        callbacks.append(ModelCheckpoint(dirpath=case["ckpt_dir"], monitor="train_loss", mode="min",
                                         save_top_k=1, save_last=True, every_n_epochs=1))
    if case.get("callbacks") == "swa":
        callbacks.append(StochasticWeightAveraging(swa_lrs=1e-2))
    if case.get("summary"):
        callbacks.append(ModelSummary(max_depth=1))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=make_strategy(case["strategy"]),
        precision=case.get("precision", "32-true"), max_epochs=case.get("epochs", 2),
        accumulate_grad_batches=case.get("accumulate", 1), gradient_clip_val=case.get("clip"),
        gradient_clip_algorithm=case.get("clip_algorithm"),
        logger=False, enable_checkpointing=bool(case.get("ckpt_dir")), enable_progress_bar=False,
        enable_model_summary=bool(case.get("summary")), num_sanity_val_steps=0, callbacks=callbacks or None)
    report: dict = {}
    if case.get("summary"):
        summary_cb = next(cb for cb in trainer.callbacks if isinstance(cb, ModelSummary))
        captured = {}
        original = summary_cb.on_fit_start

        def on_fit_start(trainer, pl_module):
            s = summary_cb._summary(trainer, pl_module)
            captured.update(total=s.total_parameters, trainable=s.trainable_parameters,
                            layers=dict(zip(s.layer_names, s.param_nums)))
            original(trainer, pl_module)
        summary_cb.on_fit_start = on_fit_start
        report["summary"] = captured
    trainer.fit(module, loader(world, case.get("batch", 4)), ckpt_path=case.get("resume"))
    if case.get("save_weights_only"):
        trainer.save_checkpoint(case["save_weights_only"], weights_only=True)
    report["losses"] = module.losses
    if hasattr(module, "report_meta"):
        report["built_on_meta"] = module.report_meta
    report["global_step"] = trainer.global_step
    if zero_strategy.is_set_up(module):  # how many saves went to the background (ZeroStrategy(async_save=True))
        report["background_saves"] = zero_strategy.api._engine_of(module).background_save.started
    state = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(case["save_dir"], f"{case['name']}.pt"))
    if case.get("every_rank_saves"):
        torch.save(state, os.path.join(case["save_dir"], f"{case['name']}.rank{dist.get_rank()}.pt"))
    if case.get("ckpt_dir") and dist.get_rank() == 0:
        report["files"] = sorted(os.listdir(case["ckpt_dir"]))
    return report


def main() -> None:
    args, out = start()
    world = dist.get_world_size()
    finish(out, run_named_cases(args["cases"], lambda case: run_case(case, out, world)))


if __name__ == "__main__":
    main()
