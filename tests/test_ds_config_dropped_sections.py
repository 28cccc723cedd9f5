"""A ds_config's sections that zero_strategy does not use are named in one WARNING, with what is used instead.

Default logging shows WARNING and above, so a dropped ``optimizer`` (DeepSpeed would
build the optimizer from it) or ``data_types`` (DeepSpeed would accumulate gradients
in that dtype) is visible without configuring anything. Sections set to "auto" are
supplied by the front end (tests/test_auto_values.py) and are not warned about.
"""

from __future__ import annotations

import logging

import pytest

from zero_strategy import ZeroConfig
from zero_strategy._config.deepspeed import translate_deepspeed

LOGGER = "zero_strategy._config.deepspeed"
DS = {
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 5e8},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100, "total_num_steps": 1000}},
    "data_types": {"grad_accum_dtype": "fp32"},
    "activation_checkpointing": {"partition_activations": True},
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": "auto",
    "tensorboard": {"enabled": True, "output_path": "runs"},
    "elasticity": {"enabled": False},
}


@pytest.fixture
def warnings_of(caplog, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)

    def run(ds):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            ZeroConfig.from_deepspeed(ds)
        return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    return run


def test_one_warning_names_every_dropped_section(warnings_of):
    (record,) = warnings_of(DS)
    lines = record.getMessage().splitlines()[1:]
    named = [line.split(":")[0].strip() for line in lines]
    assert sorted(named) == sorted(["optimizer", "scheduler", "data_types", "activation_checkpointing",
                                    "train_batch_size", "tensorboard", "elasticity"])


@pytest.mark.parametrize("section, instead", [
    ("optimizer", "your own optimizer is used"),
    ("scheduler", "your own LR scheduler is used"),
    ("data_types", "reduce_dtype"),
    ("activation_checkpointing", "gradient_checkpointing_enable()"),
    ("train_batch_size", "data loader"),
    ("tensorboard", "front end's"),
    ("elasticity", "not used"),  # no counterpart: said so plainly
])
def test_each_section_says_what_is_used_instead(warnings_of, section, instead):
    (record,) = warnings_of(DS)
    line = next(line for line in record.getMessage().splitlines() if line.strip().startswith(f"{section}:"))
    assert instead in line


def test_auto_sections_and_tuning_knobs_are_not_warned_about(warnings_of):
    (record,) = warnings_of(DS)
    text = record.getMessage()
    assert "train_micro_batch_size_per_gpu" not in text  # "auto": the front end supplies it
    assert "overlap_comm" not in text and "reduce_bucket_size" not in text  # knobs: INFO only
    assert "train_micro_batch_size_per_gpu" in translate_deepspeed(DS).ignored


def test_a_config_with_only_zero_sections_warns_nothing(warnings_of):
    assert warnings_of({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                        "gradient_clipping": 1.0}) == []
