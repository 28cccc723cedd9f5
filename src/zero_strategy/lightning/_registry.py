"""Preset names in Lightning's strategy registries, without importing Lightning eagerly.

[Note: lazy registration]
``import lightning.pytorch`` costs several seconds (about 6 s on the 2-core CI
machine, on top of torch), so ``import zero_strategy`` must not pay for it. The
registries only need a name, a callable and a description, so we register small
factory functions that import our strategy classes on first use. Registration
happens

* at once, for a registry module that is already imported; otherwise
* right after Lightning imports it, through a meta-path finder that watches for
  ``lightning.pytorch.strategies`` and ``lightning.fabric.strategies`` (the
  registries are created there, and the Trainer / Fabric connectors read them
  only later, when a Trainer or Fabric is constructed).

The finder imports nothing itself and removes itself once all registries are
filled.

[Note: the standalone packages]
Only the unified ``lightning`` package is supported. The standalone ``pytorch_lightning``
and ``lightning_fabric`` packages are copies of the same code under other module names,
so their Trainer rejects our strategy classes (not subclasses of *their* Strategy) with a
generic "invalid strategy" message. Their registries get the preset names too, bound to a
factory that raises :data:`STANDALONE_ERROR`, which names the fix.

[Note: no import at all]
Lightning loads entry points only for callbacks (group
``lightning.pytorch.callbacks_factory``), and only after the strategy flag has been
resolved, so there is no entry-point route for strategy names. The opt-in is a
``.pth`` file (``python -m zero_strategy.lightning install-autoregister``) that
installs the same finder at interpreter start-up: it costs one import of this
small module, not of Lightning or torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

from ._presets import STANDALONE_ERROR, register_into

#: Lightning registry module -> (attribute holding the registry, which front end)
_REGISTRY_MODULES = {
    "lightning.pytorch.strategies": ("StrategyRegistry", "trainer"),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", "fabric"),
    "pytorch_lightning.strategies": ("StrategyRegistry", "standalone"),
    "lightning_fabric.strategies": ("STRATEGY_REGISTRY", "standalone"),
}

def _make_trainer_strategy(**init: Any):
    from ._strategy import ZeroStrategy

    return ZeroStrategy(**init)


def _make_fabric_strategy(**init: Any):
    from ._fabric import ZeroFabricStrategy

    return ZeroFabricStrategy(**init)


def _refuse_standalone(**init: Any):
    raise ValueError(STANDALONE_ERROR)


_FACTORIES: dict[str, Callable[..., Any]] = {"trainer": _make_trainer_strategy, "fabric": _make_fabric_strategy,
                                             "standalone": _refuse_standalone}


def register_presets(registry: Any, front_end: str) -> list[str]:
    """Register every preset of :data:`zero_strategy.PRESETS` in one Lightning registry
    (``front_end``: "trainer", "fabric" or "standalone")."""
    return register_into(registry, _FACTORIES[front_end], front_end)


def _register_module(module_name: str) -> None:
    module = sys.modules.get(module_name)
    attr, front_end = _REGISTRY_MODULES[module_name]
    registry = getattr(module, attr, None) if module is not None else None
    if registry is not None:
        register_presets(registry, front_end)


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the real loader, then fills the registry the module just created."""

    def __init__(self, loader: importlib.abc.Loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        try:
            _register_module(self._name)
        finally:
            _Finder.pending.discard(self._name)
            if not _Finder.pending:
                uninstall()

    def __getattr__(self, item):  # get_source, is_package, ... for tools that ask
        return getattr(self._loader, item)


class _Finder(importlib.abc.MetaPathFinder):
    pending: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RegisteringLoader(spec.loader, fullname)
        return spec


_FINDER = _Finder()


def uninstall() -> None:
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def register_if_available() -> None:
    """Register the presets in Lightning's registries now or as soon as Lightning creates them.

    Never imports Lightning; does nothing visible when Lightning is not installed.
    """
    for name in _REGISTRY_MODULES:
        if name in sys.modules:
            _register_module(name)
        else:
            _Finder.pending.add(name)
    if _Finder.pending and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
