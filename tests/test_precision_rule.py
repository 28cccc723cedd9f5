"""One precision rule for every front end (src/zero_strategy/_precision_rule.py).

A ZeRO config in fp32 takes the front end's precision; a config that names bf16 / fp16
must agree with the front end's flag, its fp32 default included, or the run stops
before training with a message naming both places. Lightning's Trainer and Fabric and
Accelerate decide every combination the same way.
"""

from __future__ import annotations

import textwrap

import pytest

import zero_strategy as zs
from zero_strategy._config.precision_rule import resolve_precision

import _procs
from _launch import run_code

ENGINE = ["fp32", "bf16", "fp16"]
LIGHTNING_FLAG = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
ACCELERATE_FLAG = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def _expected(config: str, wanted: str) -> str | None:
    """The rule, written out: None means refused."""
    return wanted if config in ("fp32", wanted) else None


def _outcome(fn) -> str | None:
    try:
        return fn().precision
    except zs.ZeroConfigError as err:
        assert "precision" in str(err) and "one place" in str(err), err
        return None


@pytest.mark.parametrize("config", ENGINE)
@pytest.mark.parametrize("wanted", ENGINE)
def test_rule_table(config, wanted):
    got = _outcome(lambda: resolve_precision(zs.ZeroConfig(precision=config), wanted, flag="flag", config_source="cfg",
                                             fix=lambda c: f"set it in one place ({c})"))
    assert got == _expected(config, wanted)


@pytest.mark.parametrize("config", ENGINE)
@pytest.mark.parametrize("wanted", ENGINE)
def test_lightning_trainer_and_fabric_follow_the_rule(config, wanted):
    pytest.importorskip("lightning")
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision

    flag = LIGHTNING_FLAG[wanted]
    trainer_plugin = Precision() if flag == "32-true" else MixedPrecision(flag, "cpu")
    fabric_plugin = FabricPrecision() if flag == "32-true" else FabricMixed(flag, "cpu")
    s = zs.ZeroStrategy(config={"stage": 2, "precision": config})
    s.precision_plugin = trainer_plugin
    f = zs.ZeroFabricStrategy(config={"stage": 2, "precision": config})
    f.precision = fabric_plugin
    assert _outcome(lambda: s.zero_config) == _expected(config, wanted)
    assert _outcome(lambda: f.zero_config) == _expected(config, wanted)


@pytest.mark.parametrize("config", ENGINE)
@pytest.mark.parametrize("wanted", ENGINE)
def test_accelerate_decides_the_same(config, wanted):
    pytest.importorskip("accelerate")
    from zero_strategy.accelerate._config import apply_precision

    got = _outcome(lambda: apply_precision(zs.ZeroConfig(precision=config), ACCELERATE_FLAG[wanted], "cfg"))
    assert got == _expected(config, wanted)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_default_32_true_with_a_bf16_deepspeed_file_stops_the_fit(tmp_path):
    """As a user writes it: a DeepSpeed file with bf16 enabled, no precision flag on the Trainer."""
    pytest.importorskip("lightning")
    script = textwrap.dedent("""
        import json, sys, torch
        import lightning.pytorch as pl
        from lightning.pytorch.demos.boring_classes import BoringModel
        import zero_strategy

        cfg = sys.argv[1]
        json.dump({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, open(cfg, "w"))
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=zero_strategy.ZeroStrategy(config=cfg),
                             max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
        try:
            trainer.fit(BoringModel())
        except ValueError as err:
            print("REFUSED", err)
        else:
            print("TRAINED", next(trainer.lightning_module.parameters()).dtype)
    """)
    # a process of its own (Lightning's Trainer), forked warm: the refusal is the subject, not the start
    _, stdout, log = run_code(script, tmp_path, _procs.child_env(), 180, [str(tmp_path / "ds.json")])
    assert "REFUSED" in stdout, log[-3000:]
    assert "Trainer(precision='bf16-mixed')" in stdout
