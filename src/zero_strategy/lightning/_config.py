"""Strategy arguments and Lightning precision names -> one :class:`ZeroConfig`.

Shared by the Trainer and Fabric strategies; imports no Lightning so it is cheap
to test. The only place the front ends decide numerics.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from .._precision_rule import resolve_precision
from ..config import NVMeOffload, ZeroConfig, ZeroConfigError
from ._deepspeed_kwargs import DEEPSPEED_ONLY, no_effect_message, translate_deepspeed_kwargs

ZERO_FIELDS = frozenset(f.name for f in dataclasses.fields(ZeroConfig))

#: Lightning precision flag -> ZeroConfig.precision (masters are fp32 in every case)
LIGHTNING_PRECISION = {
    "32-true": "fp32", "32": "fp32",
    "bf16-mixed": "bf16", "bf16-true": "bf16",
    "16-mixed": "fp16", "16-true": "fp16",
}
_MIXED = {"bf16": "bf16-mixed", "fp16": "16-mixed"}


def build_config(stage=None, offload_optimizer=None, offload_params=None, nvme_path=None, config=None,
                 **fields: Any) -> ZeroConfig:
    """``config`` (preset name / ZeroConfig / dict / YAML / JSON / DeepSpeed) with the explicit arguments on top.

    ``config=None`` starts from ``ZeroConfig()`` (stage 3). ``nvme_path`` becomes the
    path of every NVMe offload; giving it without any NVMe offload is an error.
    """
    deepspeed = {k: fields.pop(k) for k in list(fields) if k in DEEPSPEED_ONLY}
    unknown = [k for k in fields if k not in ZERO_FIELDS]
    if unknown:
        hint = difflib.get_close_matches(unknown[0], sorted(ZERO_FIELDS), n=1)
        raise TypeError(f"ZeroStrategy got an unexpected argument {unknown[0]!r}"
                        + (f" (did you mean {hint[0]!r}?)" if hint else "")
                        + "; it takes the arguments of Lightning's DDPStrategy and DeepSpeedStrategy and the "
                        "fields of zero_strategy.ZeroConfig: " + ", ".join(sorted(ZERO_FIELDS)))
    if deepspeed or isinstance(offload_optimizer, bool):
        ds_changes, no_effect = translate_deepspeed_kwargs(deepspeed, offload_optimizer, stage)
        if isinstance(offload_optimizer, bool):
            offload_optimizer = None  # translated into ds_changes
        fields = {**ds_changes, **fields}
        if no_effect:
            _warn_rank_zero(no_effect_message(no_effect))
    base = ZeroConfig.load(config) if config is not None else ZeroConfig()
    changes = dict(fields)
    for key, value in (("stage", stage), ("offload_optimizer", offload_optimizer),
                       ("offload_params", offload_params)):
        if value is not None:
            changes[key] = value
    if "stage" in changes and changes["stage"] != 3 and "offload_params" not in changes:
        changes["offload_params"] = None  # zero3_offload with stage=2: parameter offload cannot follow
    cfg = base.replace(**changes) if changes else base
    if nvme_path is not None:
        nvme = {k: dataclasses.replace(getattr(cfg, k), path=str(nvme_path))
                for k in ("offload_optimizer", "offload_params") if isinstance(getattr(cfg, k), NVMeOffload)}
        if not nvme:
            raise ZeroConfigError("nvme_path", "given, but nothing is offloaded to NVMe",
                                  'Set offload_optimizer="nvme" (and offload_params="nvme" for stage 3), '
                                  'or use the preset "zero3_offload_nvme".')
        cfg = cfg.replace(**nvme)
    return cfg


def with_lightning_precision(cfg: ZeroConfig, flag: str | None) -> ZeroConfig:
    """Apply a Lightning precision flag to ``cfg`` by the shared rule (``zero_strategy._config.precision_rule``).

    A config that names bf16/fp16 itself (e.g. a DeepSpeed file) must agree with the
    Trainer / Fabric flag, the default ``"32-true"`` included: Lightning cannot tell a
    default from an explicit flag, and computing in another precision than the flag says
    would go unnoticed.
    """
    if flag is None:
        return cfg
    flag = str(flag)
    if flag not in LIGHTNING_PRECISION:
        raise ValueError(f"zero_strategy does not support precision={flag!r}; use one of "
                         + ", ".join(repr(k) for k in LIGHTNING_PRECISION if "-" in k)
                         + " (parameters compute in that dtype, master weights are always fp32)")
    return resolve_precision(
        cfg, LIGHTNING_PRECISION[flag], flag=f"the Trainer / Fabric precision={flag!r}",
        config_source="the ZeroStrategy config",
        fix=lambda config: f"Set the precision in one place: Trainer(precision={_MIXED[config]!r}) (or Fabric's), "
                           "or remove precision (in a DeepSpeed file: its bf16 / fp16 section) from the ZeRO config.")


def _warn_rank_zero(message: str) -> None:
    """Once per job, not once per rank (Lightning's rank_zero_warn when Lightning is there)."""
    try:
        from lightning.fabric.utilities.rank_zero import rank_zero_warn
    except ImportError:  # pragma: no cover - the front end is only used with Lightning installed
        import warnings

        warnings.warn(message, UserWarning, stacklevel=3)
        return
    rank_zero_warn(message)


def warn_if_standalone_lightning() -> None:
    """A strategy made while ``pytorch_lightning`` is imported is likely meant for its Trainer, which rejects it
    with a generic message; say why and what to change (see [Note: the standalone packages] in _registry.py)."""
    import sys

    if "pytorch_lightning" in sys.modules or "lightning_fabric" in sys.modules:
        from ._registry import STANDALONE_ERROR

        _warn_rank_zero(STANDALONE_ERROR)
