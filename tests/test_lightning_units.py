"""One-process checks of the Lightning front end: registration, config and precision translation, errors."""

from __future__ import annotations

import sys

import pytest

import zero_strategy as zs

import _procs

PRESETS = ["zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_offload_nvme"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_import_does_not_import_lightning_and_registers_when_lightning_loads():
    code = ("import sys, zero_strategy; assert 'lightning' not in sys.modules, 'eager'; "
            "from lightning.pytorch.strategies import StrategyRegistry as T; "
            "from lightning.fabric.strategies import STRATEGY_REGISTRY as F; "
            f"missing = [n for n in {PRESETS!r} if n not in T or n not in F]; assert not missing, missing; "
            "print(T['zero3_offload']['description'])")
    out = _procs.run([sys.executable, "-c", code], 120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "optimizer state and parameter shards in CPU memory" in out.stdout


def test_registered_presets_build_strategies_with_their_config():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    for name in PRESETS:
        trainer_strategy = StrategyRegistry.get(name)
        fabric_strategy = STRATEGY_REGISTRY.get(name)
        assert isinstance(trainer_strategy, zs.ZeroStrategy)
        assert isinstance(fabric_strategy, zs.ZeroFabricStrategy)
        assert trainer_strategy.zero_config == zs.ZeroConfig.preset(name) == fabric_strategy.zero_config


def test_strategy_arguments_override_the_config():
    s = zs.ZeroStrategy(stage=2, offload_optimizer="cpu", config="zero3_offload", unit_classes=["Block"])
    cfg = s.zero_config
    assert (cfg.stage, cfg.offload_params, cfg.unit_classes) == (2, None, ("Block",))
    assert isinstance(cfg.offload_optimizer, zs.CPUOffload)
    nvme = zs.ZeroStrategy(config="zero3_offload_nvme", nvme_path="/local_nvme").zero_config
    assert nvme.offload_optimizer.path == nvme.offload_params.path == "/local_nvme"
    ds = zs.ZeroStrategy(config={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}).zero_config
    assert (ds.stage, ds.precision) == (2, "bf16")


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="did you mean 'unit_classes'"):
        zs.ZeroStrategy(unit_class=["Block"])
    with pytest.raises(zs.ZeroConfigError, match="nvme_path"):
        zs.ZeroStrategy(stage=3, nvme_path="/x")


@pytest.mark.parametrize("flag,expected", [("32-true", "fp32"), ("bf16-mixed", "bf16"), ("bf16-true", "bf16"),
                                           ("16-mixed", "fp16")])
def test_lightning_precision_plugins_are_taken_over(flag, expected):
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    from zero_strategy.lightning import ZeroPrecision

    generic = {"32-true": Precision(), "bf16-true": HalfPrecision("bf16-true")}.get(flag) or \
        MixedPrecision(flag, "cpu")
    s = zs.ZeroStrategy(stage=2)
    s.precision_plugin = generic
    assert isinstance(s.precision_plugin, ZeroPrecision) and s.precision_plugin.precision == flag
    assert s.zero_config.precision == expected


def test_fabric_precision_plugin_is_taken_over():
    from lightning.fabric.plugins.precision import MixedPrecision

    from zero_strategy.lightning import ZeroFabricPrecision

    s = zs.ZeroFabricStrategy(stage=1)
    s.precision = MixedPrecision("bf16-mixed", "cpu")
    assert isinstance(s.precision, ZeroFabricPrecision) and s.zero_config.precision == "bf16"


def test_unsupported_precision_plugin_is_refused():
    from lightning.pytorch.plugins.precision import DoublePrecision

    s = zs.ZeroStrategy()
    with pytest.raises(TypeError, match="cannot use the precision plugin DoublePrecision"):
        s.precision_plugin = DoublePrecision()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_opt_in_hook_registers_without_importing_zero_strategy(tmp_path):
    """What the .pth written by `python -m zero_strategy.lightning install-autoregister` runs."""
    from pathlib import Path

    import zero_strategy.lightning as zl

    hook = Path(zl.__file__).with_name("_autoregister_hook.py")
    code = (f"import runpy, sys; runpy.run_path({str(hook)!r}); assert 'torch' not in sys.modules; "
            "from lightning.pytorch.strategies import StrategyRegistry as T; "
            "from lightning.fabric.strategies import STRATEGY_REGISTRY as F; "
            "assert 'zero3_offload' in T and 'zero3_offload' in F")
    out = _procs.run([sys.executable, "-c", code], 120)
    assert out.returncode == 0, out.stderr[-2000:]
