"""``ZeroStrategy`` takes ``DeepSpeedStrategy``'s keyword arguments with the same meaning.

The reference is Lightning's own DeepSpeedStrategy: for each set of arguments, the
ds_config it builds (``strategy.config``, plus the fp16 section it adds at setup for
``precision="16-mixed"``) read as a DeepSpeed file must give the same ZeroConfig as
``ZeroStrategy(**the same arguments)``. Every argument of DeepSpeedStrategy.__init__ is
translated, accepted with a warning naming it, or refused with a clear error.
"""

from __future__ import annotations

import inspect
import warnings

import pytest

pytest.importorskip("lightning")
pytest.importorskip("deepspeed")

import zero_strategy as zs  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402
from zero_strategy.lightning._deepspeed_kwargs import NO_EFFECT, TRANSLATED, UNSUPPORTED  # noqa: E402

DEEPSPEED_ARGS = {name: p.default for name, p in inspect.signature(DeepSpeedStrategy.__init__).parameters.items()
                  if name != "self"}
LIGHTNING_ARGS = {"accelerator", "parallel_devices", "cluster_environment", "precision_plugin",
                  "process_group_backend", "timeout"}
OWN_ARGS = {"stage", "offload_optimizer", "nvme_path", "config"}

TABLE = [
    dict(stage=1),
    dict(stage=2),
    dict(stage=3),
    dict(stage=2, offload_optimizer=True),
    dict(stage=3, offload_optimizer=True, pin_memory=True),
    dict(stage=3, offload_parameters=True),
    dict(stage=3, offload_optimizer=True, offload_parameters=True),
    dict(stage=3, offload_optimizer=True, offload_optimizer_device="nvme", nvme_path="/nvme", optimizer_buffer_count=6),
    dict(stage=3, offload_parameters=True, offload_params_device="nvme", nvme_path="/nvme", params_buffer_count=7,
         params_buffer_size=50_000_000, pin_memory=True),
    dict(stage=3, offload_optimizer=True, offload_optimizer_device="nvme", offload_parameters=True,
         offload_params_device="nvme", nvme_path="/nvme"),
    dict(stage=2, offload_optimizer=False, offload_parameters=False),
]
LOSS_SCALE_TABLE = [
    dict(stage=2, loss_scale=1024),
    dict(stage=2, initial_scale_power=8, loss_scale_window=50, hysteresis=3, min_loss_scale=2),
    dict(stage=3, loss_scale=0, initial_scale_power=20),
]


def _deepspeed_config(kwargs: dict, precision: str | None = None) -> dict:
    from lightning.fabric.strategies.deepspeed import _format_precision_config

    strategy = DeepSpeedStrategy(**kwargs)
    config = dict(strategy.config)
    if precision:
        _format_precision_config(config, precision, strategy.loss_scale, strategy.loss_scale_window,
                                 strategy.min_loss_scale, strategy.initial_scale_power, strategy.hysteresis)
    return config


def test_every_deepspeed_argument_is_accounted_for():
    ours = set(TRANSLATED) | set(NO_EFFECT) | set(UNSUPPORTED) | LIGHTNING_ARGS | OWN_ARGS
    assert set(DEEPSPEED_ARGS) - ours == set()


@pytest.mark.parametrize("kwargs", TABLE, ids=lambda k: ",".join(f"{a}={v}" for a, v in k.items()))
def test_translated_arguments_mean_what_deepspeed_strategy_builds(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every argument here is translated: no warning
        ours = zs.ZeroStrategy(**kwargs).zero_config
    assert ours == zs.ZeroConfig.load(_deepspeed_config(kwargs))


@pytest.mark.parametrize("kwargs", LOSS_SCALE_TABLE, ids=lambda k: ",".join(f"{a}={v}" for a, v in k.items()))
def test_loss_scale_arguments_mean_what_deepspeed_strategy_builds_for_16_mixed(kwargs):
    expected = zs.ZeroConfig.load(_deepspeed_config(kwargs, precision="16-mixed"))
    assert expected.precision == "fp16"
    assert zs.ZeroStrategy(**kwargs).zero_config == expected.replace(precision="fp32")  # the Trainer flag decides


def test_offload_optimizer_false_overrides_a_preset():
    assert zs.ZeroStrategy(config="zero3_offload", offload_optimizer=False).zero_config.offload_optimizer is None


@pytest.mark.parametrize("name", sorted(NO_EFFECT))
def test_no_effect_arguments_are_accepted_with_a_warning_naming_them(name):
    default = DEEPSPEED_ARGS[name]
    value = (not default if isinstance(default, bool) else default + 1 if isinstance(default, int)
             else "cpu" if name == "remote_device" else 8)  # a value other than DeepSpeedStrategy's default
    with pytest.warns(UserWarning, match=rf"no effect here \(.*{name}: "):
        cfg = zs.ZeroStrategy(stage=2, **{name: value}).zero_config
    assert cfg == zs.ZeroConfig(stage=2)


def test_offload_settings_without_their_offload_warn():
    with pytest.warns(UserWarning, match="offload_params_device: it applies only with the offload"):
        cfg = zs.ZeroStrategy(stage=3, offload_params_device="nvme").zero_config
    assert cfg.offload_params is None


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_arguments_are_refused_by_name(name):
    refused = UNSUPPORTED[name][0]
    with pytest.raises(zs.ZeroConfigError, match=name):
        zs.ZeroStrategy(stage=2, **{name: refused})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zs.ZeroStrategy(stage=2, **{name: not refused}).zero_config == zs.ZeroConfig(stage=2)


def test_fabric_strategy_takes_the_same_arguments():
    from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeed

    fabric_args = {n for n in inspect.signature(FabricDeepSpeed.__init__).parameters if n != "self"}
    assert fabric_args - {"precision"} == set(DEEPSPEED_ARGS) - {"precision_plugin"}
    kwargs = dict(stage=3, offload_optimizer=True, offload_parameters=True)
    assert zs.ZeroFabricStrategy(**kwargs).zero_config == zs.ZeroStrategy(**kwargs).zero_config
