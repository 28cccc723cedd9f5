"""Our preset names as Lightning strategies: the error for the standalone packages and the
registration itself, which the strategy classes and the start-up registry (_registry.py) share.

Below both: ``ZeroStrategy.register_strategies`` registers its own class here, and
the registry registers factories that import the classes on first use.
"""

from __future__ import annotations

from typing import Any, Callable

from ..config import PRESETS

STANDALONE_ERROR = (
    "zero_strategy works with the `lightning` package, not with the standalone `pytorch_lightning` / "
    "`lightning_fabric` packages (separate copies of Lightning's classes, which reject ours). Fix: "
    "`pip install lightning` and write `import lightning.pytorch as pl` instead of `import pytorch_lightning as pl` "
    "(`from lightning.fabric import Fabric` instead of `from lightning_fabric import Fabric`); the strategy "
    "names and arguments stay the same.")


def register_into(registry: Any, factory: Callable[..., Any], front_end: str) -> list[str]:
    """Register every preset of :data:`zero_strategy.PRESETS` in ``registry`` as ``factory``.

    A name already registered by someone else is left alone: ours are the entries whose
    factory comes from this package (a class of ours, or a registry factory), so a
    second registration replaces ours and never a user's own strategy of that name.
    """
    names = []
    for name, (description, _) in PRESETS.items():
        if name in registry and not _ours(registry[name].get("strategy")):
            continue  # someone else's strategy of that name: never override it
        note = " (needs the `lightning` package, not this standalone one)" if front_end == "standalone" else ""
        registry.register(name, factory, description=f"zero_strategy ZeRO {description}{note}", override=True,
                          config=name)
        names.append(name)
    return names


def _ours(factory: Any) -> bool:
    return (getattr(factory, "__module__", None) or "").split(".")[0] == "zero_strategy"
