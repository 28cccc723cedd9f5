"""Lightning ``Trainer.fit`` with torch.compile, in Lightning's two idioms, on 2 CPU ranks.

args["cases"]: dicts with name, strategy ("ddp" or a dict for ``ZeroStrategy(**dict)``),
compile (None; "configure_model": ``block.compile()`` for each block in ``configure_model``; "module": ``trainer.fit(torch.compile(module))``).
Each case reports its per-step losses; rank 0 saves the final weights to
``<save_dir>/<name>.pt``.
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

BACKEND = "aot_eager"


class LitCompiled(pl.LightningModule):
    """The TinyLM built in ``__init__`` (it has a parameter no ``reset_parameters`` would
    initialize on the meta device), compiled in ``configure_model``."""

    def __init__(self, compile_blocks: bool):
        super().__init__()
        self.compile_blocks = compile_blocks
        torch.manual_seed(1234)
        self.model = TinyLM(layers=2)
        self.losses: list[float] = []

    def configure_model(self):
        if self.compile_blocks:
            for block in self.model.layers:
                block.compile(backend=BACKEND)

    def forward(self, tokens):
        return self.model(tokens)

    def training_step(self, batch, batch_idx):
        loss = loss_fn(self(batch[0]), batch[1])
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(param_groups(self.model))


def _loader(world: int) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    n = 3 * 4 * world
    data = TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g))
    return DataLoader(data, batch_size=4, shuffle=False)


def run_case(case: dict, world: int) -> dict:
    strategy = case["strategy"]
    if isinstance(strategy, dict):
        strategy = zero_strategy.ZeroStrategy(**strategy)
    module = LitCompiled(compile_blocks=case.get("compile") == "configure_model")
    fitted = torch.compile(module, backend=BACKEND) if case.get("compile") == "module" else module
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(fitted, _loader(world))
    state = {k.replace("_orig_mod.", ""): v.detach().float().clone() for k, v in module.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(case["save_dir"], f"{case['name']}.pt"))
    compiled = module._compiler_ctx is not None or any(m._compiled_call_impl is not None for m in module.modules())
    return {"losses": [float(x) for x in module.losses], "compiled": compiled}


def main() -> None:
    args, out = start()
    world = dist.get_world_size()
    finish(out, run_named_cases(args["cases"], lambda case: run_case(case, world)))


if __name__ == "__main__":
    main()
