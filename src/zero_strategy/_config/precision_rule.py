"""One rule for a front end's precision flag against the ZeRO config's precision.

Every front end has two places that name the compute precision: its own flag
(Lightning's ``Trainer(precision=...)`` / ``Fabric(precision=...)``, Accelerate's
``mixed_precision``) and the ZeRO config (``ZeroConfig.precision``, or the ``bf16`` /
``fp16`` sections of a DeepSpeed file). The rule:

* a config in fp32 (the default, and every preset) takes the front end's precision;
* a config that names bf16 or fp16 must agree with the front end's flag, *including*
  the front end's default fp32 (``"32-true"``, ``mixed_precision="no"``): a run that
  silently computes in another precision than the flag says is the failure this
  prevents. The error names both places and how to set it in one.

The front ends translate their flag to ``"fp32" | "bf16" | "fp16"`` and call
:func:`resolve_precision`; this module imports nothing from them.
"""

from __future__ import annotations

from typing import Callable

from ..config import ZeroConfig, ZeroConfigError

ENGINE_PRECISIONS = ("fp32", "bf16", "fp16")


def resolve_precision(cfg: ZeroConfig, wanted: str, *, flag: str, config_source: str,
                      fix: Callable[[str], str]) -> ZeroConfig:
    """``cfg`` with the front end's precision ``wanted``, or a :class:`ZeroConfigError` on a clash.

    Args:
        wanted: the front end's precision in engine terms (``"fp32"``, ``"bf16"``, ``"fp16"``).
        flag: how the user wrote it, for the message (``"Trainer(precision='32-true')"``).
        config_source: where the config came from (``"the ZeroStrategy config"``, a file name).
        fix: the config's precision -> how to set the precision in one place in this front end.
    """
    if wanted not in ENGINE_PRECISIONS:
        raise ValueError(f"resolve_precision: wanted must be one of {ENGINE_PRECISIONS}, got {wanted!r}")
    if cfg.precision == wanted:
        return cfg
    if cfg.precision != "fp32":
        raise ZeroConfigError("precision", f"{config_source} says {cfg.precision!r} but {flag} asks for {wanted!r}",
                              fix(cfg.precision))
    return cfg.replace(precision=wanted)
