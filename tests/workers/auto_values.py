"""The ZeroConfig each front end builds from a ds_config, for the "auto" table of tests/test_auto_values.py.

One plain process (no launcher): for every (row, precision, front end) it builds the
front end's own object the way users do (``pl.Trainer(strategy=ZeroStrategy(config=ds),
precision=...)``, ``Fabric(...)``, ``ZeroAccelerator(ds, mixed_precision=...)``,
``ZeroTrainer(args=TrainingArguments(bf16=...), zero_config=ds)``,
``ZeroConfig.from_deepspeed(ds)``) and reports the resolved config as a dict, for the
ds_config with the row's key set to "auto" and for its explicit equivalent.
Accelerate's process state is reset between objects (it is a per-process singleton).
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

#: front-end precision -> (Lightning flag, Accelerate mixed_precision, TrainingArguments kwargs)
PRECISIONS = {
    "fp32": ("32-true", "no", {}),
    "bf16": ("bf16-mixed", "bf16", {"bf16": True}),
    "fp16": ("16-true", "fp16", {"fp16": True}),  # Lightning turns "16-mixed" into bf16 on CPU; 16-true it keeps
}


def lightning_trainer(ds, precision):
    import lightning.pytorch as pl

    from zero_strategy import ZeroStrategy

    trainer = pl.Trainer(strategy=ZeroStrategy(config=ds), precision=PRECISIONS[precision][0], accelerator="cpu",
                         devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    return trainer.strategy.zero_config


def fabric(ds, precision):
    from lightning.fabric import Fabric

    from zero_strategy.lightning import ZeroFabricStrategy

    return Fabric(strategy=ZeroFabricStrategy(config=ds), precision=PRECISIONS[precision][0], accelerator="cpu",
                  devices=1).strategy.zero_config


def accelerate(ds, precision):
    from accelerate.state import AcceleratorState

    from zero_strategy.accelerate import ZeroAccelerator

    AcceleratorState._reset_state(True)
    return ZeroAccelerator(ds, mixed_precision=PRECISIONS[precision][1], cpu=True).zero_config


def hf_trainer(ds, precision):
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments

    from zero_strategy.transformers import ZeroTrainer

    AcceleratorState._reset_state(True)
    args = TrainingArguments(tempfile.mkdtemp(prefix="zs_auto_"), use_cpu=True, report_to=[],
                             **PRECISIONS[precision][2])
    return ZeroTrainer(model=torch.nn.Linear(2, 2), args=args, zero_config=ds).accelerator.zero_config


def plain(ds, precision):
    from zero_strategy import ZeroConfig

    assert precision == "fp32"  # the plain API has no precision setting of its own to resolve "auto" from
    return ZeroConfig.from_deepspeed(ds)


FRONT_ENDS = {"lightning_trainer": lightning_trainer, "fabric": fabric, "accelerate": accelerate,
              "hf_trainer": hf_trainer, "plain": plain}


def main() -> None:
    out = Path(sys.argv[1])
    table = json.loads((out / "args.json").read_text())["table"]
    cache: dict[str, dict] = {}
    report = []
    for row in table:
        for precision in row["precisions"]:
            for name, build in FRONT_ENDS.items():
                if name == "plain" and precision != "fp32":
                    continue
                entry = {"row": row["key"], "precision": precision, "front_end": name}
                for variant in ("auto", "explicit"):
                    ds = row[variant][precision]
                    key = json.dumps([name, precision, ds], sort_keys=True)
                    if key not in cache:
                        try:
                            cache[key] = {"config": build(ds, precision).to_dict()}
                        except Exception as err:  # noqa: BLE001 - reported to the test
                            cache[key] = {"error": f"{type(err).__name__}: {err}"}
                    entry[variant] = cache[key]
                report.append(entry)
    (out / "rank0.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
