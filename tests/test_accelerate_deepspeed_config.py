"""A DeepSpeed user's accelerate config runs with ZeroAccelerator, changing only the import.

Accelerate configs as ``accelerate config`` writes them for DeepSpeed
(``distributed_type: DEEPSPEED``), once with a ``deepspeed_config_file`` (the Hugging
Face docs' style: "auto" values, ``optimizer``/``scheduler`` sections) and once with the
inline ``zero_stage`` / ``offload_optimizer_device`` / ``gradient_accumulation_steps`` /
``gradient_clipping`` keys, both launched with ``accelerate launch`` on 2 CPU processes.
The script is the same Accelerate loop in every run; only its import differs
(``from zero_strategy.accelerate import Accelerator``). Oracle: the same script with
``from accelerate import Accelerator`` on the shipped MULTI_GPU CPU config (stock
Accelerate, DDP) with the accumulation the DeepSpeed config asks for; weights within
1e-5 relative. The same for a Hugging Face ``Trainer`` script whose one change is
``from zero_strategy.transformers import zero_trainer``, against the stock ``Trainer``
(DDP); there "auto" clipping is the Trainer's ``max_grad_norm``, as in the HF
integration. See [Note: adopting a DeepSpeed launch] in zero_strategy/accelerate/_launch.py.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from _accelerate_launch import accelerate_launch, launch_env  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(600)]

DS_JSON = {  # the Hugging Face docs' ZeRO-3 style, "auto" where the integration fills values in
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
    "gradient_accumulation_steps": 2,
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
COMMON = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""
FILE_CONFIG = COMMON + """deepspeed_config:
  deepspeed_config_file: ds.json
  zero3_init_flag: false
"""
INLINE_CONFIG = COMMON + """deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
"""


@pytest.fixture(scope="module")
def runs():
    pytest.importorskip("deepspeed", reason="accelerate launch starts a DEEPSPEED config only with deepspeed installed")
    work = Path(tempfile.mkdtemp(prefix="zs_dscfg_"))
    try:
        (work / "ds.json").write_text(json.dumps(DS_JSON, indent=2))
        (work / "ds_file.yaml").write_text(FILE_CONFIG)
        (work / "ds_inline.yaml").write_text(INLINE_CONFIG)
        results = {}
        for name, config in (("file", "ds_file.yaml"), ("inline", "ds_inline.yaml")):
            # the config file through Accelerate's own launcher process and torchrun, as users type it
            # (each process a warm interpreter behind the zygote's shim: their start is not the subject);
            # the inline config's launch is the warm one ([Note: warm Accelerate launches])
            results[name] = accelerate_launch("accelerate_deepspeed_launch.py", {"front": "zero"},
                                              config=work / config, cwd=work, real_launcher=name == "file",
                                              warm_behind_launcher=True)
        results["stock_ddp"] = accelerate_launch(
            "accelerate_deepspeed_launch.py", {"front": "stock"},
            env=launch_env(ACCELERATE_GRADIENT_ACCUMULATION_STEPS="2"))
        (work / "hf_ds.json").write_text(json.dumps({**DS_JSON, "zero_optimization": {"stage": 2},
                                                     "gradient_accumulation_steps": "auto"}))
        (work / "hf_ds.yaml").write_text(FILE_CONFIG.replace("ds.json", "hf_ds.json"))
        results["hf"] = accelerate_launch("hf_trainer_deepspeed_launch.py", {"front": "zero"},
                                          config=work / "hf_ds.yaml", cwd=work)
        results["hf_stock_ddp"] = accelerate_launch("hf_trainer_deepspeed_launch.py", {"front": "stock"})
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("name", ["file", "inline"])
def test_the_launch_is_two_gloo_processes_not_deepspeed(runs, name):
    reports, log = runs[name]
    for r in reports:
        assert r["num_processes"] == 2, log[-3000:]
        assert r["distributed_type"].endswith("MULTI_CPU")


def test_the_deepspeed_config_file_is_the_zero_config(runs):
    for r in runs["file"][0]:
        assert r["zero_config"] == {"stage": 3, "precision": "fp32", "gradient_clipping": 1.0,
                                    "offload_optimizer": "cpu", "offload_params": None}
        assert r["gradient_accumulation_steps"] == 2  # the ds.json's value wins, as in Accelerate


def test_the_inline_deepspeed_keys_are_the_zero_config(runs):
    for r in runs["inline"][0]:
        assert r["zero_config"] == {"stage": 2, "precision": "fp32", "gradient_clipping": 1.0,
                                    "offload_optimizer": "cpu", "offload_params": None}
        assert r["gradient_accumulation_steps"] == 2


def test_the_reference_really_is_stock_ddp_with_clipping(runs):
    reports, _ = runs["stock_ddp"]
    for r in reports:
        assert r["zero_config"] is None and r["gradient_accumulation_steps"] == 2
        assert max(r["norms"]) > 1.0, "clipping at 1.0 must bite for the comparison to cover it"


@pytest.mark.parametrize("name", ["file", "inline"])
def test_training_equals_stock_accelerate_ddp(runs, name):
    ref = runs["stock_ddp"][0][0]
    for r in runs[name][0]:
        assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert r["weights"] == pytest.approx(ref["weights"], rel=1e-5, abs=1e-6)


def test_dropped_sections_are_warned_once_not_per_rank(runs):
    _, log = runs["file"]
    assert log.count("section(s) not used by zero_strategy") == 1, log[-4000:]
    for section in ("optimizer", "scheduler"):
        assert f"\n  {section}: " in log


def test_hf_trainer_reads_the_deepspeed_launch_as_its_integration_does(runs):
    for r in runs["hf"][0]:
        assert r["distributed_type"].endswith("MULTI_CPU") and r["num_processes"] == 2
        assert r["zero_config"] == {"stage": 2, "gradient_clipping": None, "precision": "fp32"}


def test_hf_trainer_under_the_deepspeed_launch_equals_the_stock_trainer(runs):
    ref = runs["hf_stock_ddp"][0][0]
    assert max(ref["grad_norms"]) > 0.5, "max_grad_norm=0.5 must bite for the comparison to cover clipping"
    for r in runs["hf"][0]:
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
        assert r["weights"] == pytest.approx(ref["weights"], rel=1e-5, abs=1e-6)
