"""Which ZeroConfig a ZeroAccelerator runs with, and its precision from Accelerate's setting.

[Note: where the config comes from]
1. ``ZeroAccelerator(zero_config=...)``: a preset name, a YAML/JSON path (ours or a
   DeepSpeed ``ds_config``), a mapping, or a :class:`~zero_strategy.ZeroConfig`;
2. else the environment variable ``ZERO_STRATEGY_CONFIG`` (a preset name or a path),
   so a launch command can pick the preset without touching the script;
3. else the ds_config of a DEEPSPEED accelerate launch (see [Note: adopting a
   DeepSpeed launch] in _launch.py), so a DeepSpeed user's launch config works as is;
4. else :data:`DEFAULT_PRESET`, the one default of every front end (see
   [Note: the default preset]).

[Note: the default preset]
``zero3`` everywhere: ``ZeroConfig()``, ``zero_strategy.setup`` without a config,
``ZeroStrategy()`` / ``ZeroFabricStrategy()``, ``ZeroAccelerator()`` and
``ZeroTrainer``. The reason to pick ZeRO over DDP is memory, and stage 3 is the only
stage whose per-rank model states all shrink with the number of ranks (16Ψ/N against
DDP's 16Ψ). Its costs are known and loud, never silent: 1.5× DDP's communication, and
parameters that must be gathered to be read (``gathered_parameters``; ``state_dict`` is
a collective). A model that fits with stage 2 trains with DDP's communication volume:
choose ``zero2`` (README, "Choosing a preset").

[Note: precision has one source, Accelerate]
``mixed_precision`` ("no" / "bf16" / "fp16", from the argument, ``--mixed_precision``
or the launch config) becomes ``ZeroConfig.precision``. A ZeRO config that names a
different low precision is an error rather than a silent choice between the two;
``precision: fp32`` (also the default) in the ZeRO config means "not specified".
DeepSpeed ``"auto"`` values are resolved by the one resolver all front ends share
(:mod:`zero_strategy._config.deepspeed_auto`): ``"auto"`` precision is this one. One
exception, kept from Accelerate's DeepSpeed integration: under an adopted DeepSpeed
launch, a ds_config that enables bf16/fp16 itself wins over ``mixed_precision: no``
(Accelerate's DeepSpeed plugin does the same).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .._precision_rule import resolve_precision
from ..config import ZeroConfig, ZeroConfigError

from ._launch import deepspeed_launch_config, logger

ENV_VAR = "ZERO_STRATEGY_CONFIG"
DEFAULT_PRESET = "zero3"  # see [Note: the default preset]
DEEPSPEED_LAUNCH = "DeepSpeed launch"

#: Accelerate's mixed_precision -> ZeroConfig.precision
PRECISION_OF = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def choose_spec(zero_config: Any, deepspeed_auto_clipping: float | None = 1.0) -> tuple[Any, str]:
    """``(spec, where it came from)`` following the order in the module note."""
    launch = deepspeed_launch_config(deepspeed_auto_clipping)
    env = os.environ.get(ENV_VAR, "").strip()
    chosen = (zero_config, "zero_config") if zero_config is not None else (env, f"{ENV_VAR}={env}") if env else None
    if chosen is not None:
        if launch is not None:
            logger.warning("ZeroAccelerator: launched with a DeepSpeed accelerate config, but %s is used as the ZeRO "
                           "config instead of %s", chosen[1], launch[1])
        return chosen
    if launch is not None:
        return launch[0], f"{launch[1]} ({DEEPSPEED_LAUNCH})"
    return DEFAULT_PRESET, f"default preset {DEFAULT_PRESET!r} (no zero_config and {ENV_VAR} unset)"


def load_config(spec: Any, source: str) -> ZeroConfig:
    """Parse ``spec`` into a ZeroConfig (a ds_config's "auto" values by the shared resolver)."""
    try:
        return ZeroConfig.load(spec)
    except ZeroConfigError as err:
        raise err if err.source else err.from_source(source)


def apply_precision(cfg: ZeroConfig, mixed_precision: str, source: str) -> ZeroConfig:
    """``cfg`` with Accelerate's ``mixed_precision`` as its precision (see the module note)."""
    if mixed_precision not in PRECISION_OF:
        raise ValueError(
            f"ZeroAccelerator: mixed_precision={mixed_precision!r} is not supported; use 'no', 'bf16' or "
            "'fp16' (ZeRO keeps fp32 master weights and computes in bf16/fp16 parameters)")
    wanted = PRECISION_OF[mixed_precision]
    if cfg.precision != "fp32" and wanted == "fp32" and source.endswith(f"({DEEPSPEED_LAUNCH})"):
        return cfg  # as Accelerate's DeepSpeed plugin: the ds_config's own fp16/bf16 wins over "no"
    return resolve_precision(
        cfg, wanted, flag=f"Accelerate's mixed_precision={mixed_precision!r}",
        config_source=f"the ZeRO config ({source})",
        fix=lambda p: (f"Set the precision in one place: launch with --mixed_precision "
                       f"{'fp16' if p == 'fp16' else 'bf16'} (or mixed_precision in the accelerate config / "
                       "Accelerator(mixed_precision=...)) and drop precision from the ZeRO config."))


def describe(cfg: ZeroConfig) -> str:
    extras = []
    if cfg.offload_optimizer is not None:
        extras.append(f"offload_optimizer={cfg.offload_optimizer.device}")
    if cfg.offload_params is not None:
        extras.append(f"offload_params={cfg.offload_params.device}")
    return f"stage {cfg.stage}, precision {cfg.precision}" + "".join(f", {e}" for e in extras)


def deepspeed_accumulation_steps(spec: Any, source: str) -> int | None:
    """A numeric ``gradient_accumulation_steps`` of an adopted DeepSpeed launch's ds_config (it wins, as in Accelerate)."""
    if not source.endswith(f"({DEEPSPEED_LAUNCH})") or not isinstance(spec, Mapping):
        return None
    value = spec.get("gradient_accumulation_steps")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
