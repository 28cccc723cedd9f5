"""Which ZeroConfig a ZeroAccelerator runs with, and its precision from Accelerate's setting.

[Note: where the config comes from]
1. ``ZeroAccelerator(zero_config=...)``: a preset name, a YAML/JSON path (ours or a
   DeepSpeed ``ds_config``), a mapping, or a :class:`~zero_strategy.ZeroConfig`;
2. else the environment variable ``ZERO_STRATEGY_CONFIG`` (a preset name or a path),
   so a launch command can pick the preset without touching the script;
3. else :data:`DEFAULT_PRESET` (``zero2``): it moves exactly as many bytes per step as
   the DDP it replaces, so swapping ``Accelerator`` for ``ZeroAccelerator`` never
   slows a run down, and still shards optimizer state and gradients.

[Note: precision has one source, Accelerate]
``mixed_precision`` ("no" / "bf16" / "fp16", from the argument, ``--mixed_precision``
or the launch config) becomes ``ZeroConfig.precision``. A ZeRO config that names a
different low precision is an error rather than a silent choice between the two;
``precision: fp32`` (also the default) in the ZeRO config means "not specified".
DeepSpeed configs written for the Hugging Face integration say ``"auto"`` for
``fp16.enabled`` / ``bf16.enabled`` / ``gradient_clipping``; the engine refuses
``"auto"``, so it is resolved here: the precision from Accelerate, clipping off in
the engine (clip with ``accelerator.clip_grad_norm_``, which the HF Trainer does).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import ZeroConfig, ZeroConfigError

ENV_VAR = "ZERO_STRATEGY_CONFIG"
DEFAULT_PRESET = "zero2"

#: Accelerate's mixed_precision -> ZeroConfig.precision
PRECISION_OF = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def choose_spec(zero_config: Any) -> tuple[Any, str]:
    """``(spec, where it came from)`` following the order in the module note."""
    if zero_config is not None:
        return zero_config, "zero_config"
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env, f"{ENV_VAR}={env}"
    return DEFAULT_PRESET, f"default preset {DEFAULT_PRESET!r} (no zero_config and {ENV_VAR} unset)"


def load_config(spec: Any, source: str, mixed_precision: str | None) -> ZeroConfig:
    """Parse ``spec`` into a ZeroConfig, resolving DeepSpeed ``"auto"`` values first.

    ``mixed_precision``: Accelerate's setting, used for ``"auto"``; ``None`` while it
    is not known yet (an early parse to report bad configs before the process group).
    """
    data = _deepspeed_mapping(spec)
    try:
        if data is not None:
            return ZeroConfig.from_deepspeed(_resolve_auto(data, mixed_precision or "no"))
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
    if cfg.precision == wanted:
        return cfg
    if cfg.precision != "fp32":
        raise ZeroConfigError(
            "precision", f"the ZeRO config ({source}) says {cfg.precision!r} but Accelerate's mixed_precision is "
            f"{mixed_precision!r}",
            f"Set the precision in one place: launch with --mixed_precision "
            f"{'fp16' if cfg.precision == 'fp16' else 'bf16'} (or mixed_precision in the accelerate config / "
            "Accelerator(mixed_precision=...)) and drop precision from the ZeRO config.")
    return cfg.replace(precision=wanted)


def describe(cfg: ZeroConfig) -> str:
    extras = []
    if cfg.offload_optimizer is not None:
        extras.append(f"offload_optimizer={cfg.offload_optimizer.device}")
    if cfg.offload_params is not None:
        extras.append(f"offload_params={cfg.offload_params.device}")
    return f"stage {cfg.stage}, precision {cfg.precision}" + "".join(f", {e}" for e in extras)


# ------------------------------------------------------------------ DeepSpeed "auto"

def _deepspeed_mapping(spec: Any) -> dict | None:
    """The spec as a mapping when it is a DeepSpeed config (inline or a file); else None."""
    if isinstance(spec, Mapping):
        return dict(spec) if "zero_optimization" in spec else None
    if not isinstance(spec, (str, os.PathLike)):
        return None
    path = Path(os.fspath(spec))
    if path.suffix.lower() not in (".json", ".yaml", ".yml") or not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception:  # noqa: BLE001 - ZeroConfig.load reports syntax errors with line numbers
        return None
    return data if isinstance(data, Mapping) and "zero_optimization" in data else None


def _resolve_auto(data: Mapping, mixed_precision: str) -> dict:
    out = copy.deepcopy(dict(data))
    for name, on in (("fp16", mixed_precision == "fp16"), ("bf16", mixed_precision == "bf16"),
                     ("bfloat16", mixed_precision == "bf16")):
        section = out.get(name)
        if isinstance(section, Mapping) and _is_auto(section.get("enabled")):
            out[name] = {**section, "enabled": on}
    if _is_auto(out.get("gradient_clipping")):
        del out["gradient_clipping"]
    return out


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"
