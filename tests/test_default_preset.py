"""One default preset across front ends: ``zero3`` (see [Note: the default preset] in zero_strategy/accelerate/_config.py).

Each front end is built the way users build it without naming a config, and the ZeRO
config it ends up with must be the ``zero3`` preset (with the front end's default
precision, fp32): ``zero_strategy.setup(model, optimizer)``, ``ZeroStrategy()`` in a
Lightning ``Trainer``, ``ZeroFabricStrategy()`` in ``Fabric``, ``ZeroAccelerator()`` and
``ZeroTrainer(...)`` without ``zero_config``. Built in one child process (Accelerate's
state is a per-process singleton; a process group is needed for ``setup``).
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
pytest.importorskip("transformers")

import _procs  # noqa: E402
from _zygote import warm_command  # noqa: E402
from _accelerate_launch import launch_env  # noqa: E402

CODE = r"""
import json, tempfile, warnings, torch
warnings.filterwarnings("ignore")
import torch.distributed as dist
import zero_strategy as zs
from zero_strategy import ZeroStrategy
from zero_strategy.lightning import ZeroFabricStrategy
from zero_strategy.accelerate import ZeroAccelerator
from zero_strategy.transformers import ZeroTrainer
from accelerate.state import AcceleratorState
from transformers import TrainingArguments
import lightning.pytorch as pl
from lightning.fabric import Fabric

out = {}
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%(port)d", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
model, opt = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
out["setup"] = opt.engine.config.to_dict()
zs.teardown(model)
dist.destroy_process_group()
trainer = pl.Trainer(strategy=ZeroStrategy(), accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
out["lightning_trainer"] = trainer.strategy.zero_config.to_dict()
out["fabric"] = Fabric(strategy=ZeroFabricStrategy(), accelerator="cpu", devices=1).strategy.zero_config.to_dict()
AcceleratorState._reset_state(True)
out["accelerate"] = ZeroAccelerator(cpu=True).zero_config.to_dict()
AcceleratorState._reset_state(True)
args = TrainingArguments(tempfile.mkdtemp(), use_cpu=True, report_to=[])
out["hf_trainer"] = ZeroTrainer(model=torch.nn.Linear(2, 2), args=args).accelerator.zero_config.to_dict()
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def defaults() -> dict:
    cmd, env = warm_command([sys.executable, "-c", CODE % {"port": _procs.free_port()}], launch_env())
    proc = _procs.run(cmd, 240, env=env)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line is not None, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(line[len("RESULT"):])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["setup", "lightning_trainer", "fabric", "accelerate", "hf_trainer"])
def test_the_default_is_the_zero3_preset(defaults, front_end):
    from zero_strategy import ZeroConfig

    assert defaults[front_end] == ZeroConfig.preset("zero3").to_dict()


def test_the_default_preset_constant_names_it():
    from zero_strategy import ZeroConfig
    from zero_strategy.accelerate import DEFAULT_PRESET

    assert DEFAULT_PRESET == "zero3" and ZeroConfig.preset(DEFAULT_PRESET) == ZeroConfig()
