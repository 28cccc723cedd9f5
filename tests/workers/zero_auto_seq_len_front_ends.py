"""``zero_auto`` with the step's shape (``seq_len``, ``batch_size``) given the way each front end's
users give a config (tests/test_zero_auto_seq_len_front_ends.py).

One rank. Memory is injected through the measurement seam (``zero_strategy._zero_auto.measure_available``
returns ``args["available"]``) before any front end sets up, so each case's choice depends on the
shape alone. Each case builds the Llama of ``args["llama"]`` (LlamaConfig arguments) and sets it up
through one front end; it reports the config of the engine that front end set up (``to_dict``).

args["cases"]: name (the route), route (below), shape (``{"seq_len": L}`` or with ``batch_size``).
Routes: ``accelerate_argument`` (``ZeroAccelerator(zero_config={...})`` then ``prepare``),
``accelerate_file`` (``zero_config=<YAML file>``), ``accelerate_env`` (``ZERO_STRATEGY_CONFIG=<JSON
file>``, no ``zero_config``), ``hf_trainer`` (``ZeroTrainer(zero_config={...})``, one step of
``train``), ``lightning_arguments`` (``ZeroStrategy(config="zero_auto", seq_len=...)``, one step of
``fit``), ``lightning_file`` (``ZeroStrategy(config=<YAML file>)``), ``fabric_arguments``
(``ZeroFabricStrategy(config="zero_auto", **shape)``, then ``fabric.setup``).
"""

from __future__ import annotations

import json
import os

import torch

from _tiny_trainer_data import Tokens
from _worker import finish, run_named_cases, start
from zero_strategy.transformers import ZeroTrainer  # before TrainingArguments (see its module note)

import lightning.pytorch as pl  # noqa: E402
import transformers  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

import zero_strategy as zs  # noqa: E402
from zero_strategy import AvailableMemory  # noqa: E402
from zero_strategy import _zero_auto  # noqa: E402
from zero_strategy.accelerate import ZeroAccelerator  # noqa: E402
from zero_strategy.lightning import ZeroFabricStrategy, ZeroStrategy  # noqa: E402


def llama(args: dict) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**args["llama"]))


def spec(case: dict) -> dict:
    return {"preset": "zero_auto", **case["shape"]}


def config_file(case: dict, out, suffix: str) -> str:
    path = out / f"{case['name']}.{suffix}"
    yaml = "".join(f"{key}: {value}\n" for key, value in spec(case).items())
    path.write_text(yaml if suffix == "yaml" else json.dumps(spec(case)))
    return str(path)


def through_accelerate(model, zero_config) -> dict:
    accelerator = ZeroAccelerator(zero_config=zero_config)
    model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    chosen = zs.engine_of(model).config
    zs.teardown(model)
    return chosen.to_dict()


def through_hf_trainer(model, case: dict, out) -> dict:
    args = transformers.TrainingArguments(output_dir=str(out / case["name"]), per_device_train_batch_size=2,
                                          max_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                                          dataloader_num_workers=0)
    trainer = ZeroTrainer(model=model, args=args, train_dataset=Tokens(), zero_config=spec(case))
    trainer.train()  # the engine is set up when train() prepares the model
    chosen = zs.engine_of(model).config
    zs.teardown(model)
    return chosen.to_dict()


class LitLlama(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters())


def through_lightning(model, strategy: ZeroStrategy) -> dict:
    lit = LitLlama(model)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lit, torch.utils.data.DataLoader(Tokens(), batch_size=2))
    chosen = zs.engine_of(lit).config  # the engine outlives fit (See [Note: engine lifetime])
    trainer.strategy.teardown()
    return chosen.to_dict()


def through_fabric(model, strategy: ZeroFabricStrategy) -> dict:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    fabric.setup(model, torch.optim.AdamW(model.parameters()))  # sets the module up in place
    chosen = zs.engine_of(model).config
    zs.teardown(model)
    return chosen.to_dict()


def run(case: dict, args: dict, out) -> dict:
    model, route = llama(args), case["route"]
    if route == "accelerate_argument":
        return through_accelerate(model, spec(case))
    if route == "accelerate_file":
        return through_accelerate(model, config_file(case, out, "yaml"))
    if route == "accelerate_env":
        os.environ["ZERO_STRATEGY_CONFIG"] = config_file(case, out, "json")
        try:
            return through_accelerate(model, None)
        finally:
            del os.environ["ZERO_STRATEGY_CONFIG"]
    if route == "hf_trainer":
        return through_hf_trainer(model, case, out)
    if route == "lightning_arguments":
        return through_lightning(model, ZeroStrategy(config="zero_auto", **case["shape"]))
    if route == "lightning_file":
        return through_lightning(model, ZeroStrategy(config=config_file(case, out, "yaml")))
    if route == "fabric_arguments":
        return through_fabric(model, ZeroFabricStrategy(config="zero_auto", **case["shape"]))
    raise ValueError(f"unknown route {route!r}")


def main() -> None:
    args, out = start()
    available = AvailableMemory(**args["available"])
    _zero_auto.measure_available = lambda comm, device, config: available
    finish(out, run_named_cases(args["cases"], lambda case: {"chosen": run(case, args, out)}))


if __name__ == "__main__":
    main()
