"""Run at interpreter start by ``zero_strategy_lightning.pth`` (opt-in; see ``__main__.py``),
from wherever ``zero_strategy`` is installed at that moment (the .pth stores no path).

Self-contained on purpose: it imports neither torch nor zero_strategy (a .pth line
runs in every Python process). When Lightning creates a strategy registry, it
imports ``zero_strategy``, whose import registers the presets.
"""

import importlib.abc
import importlib.machinery
import sys

_WATCHED = {"lightning.pytorch.strategies", "lightning.fabric.strategies",
            "pytorch_lightning.strategies", "lightning_fabric.strategies"}


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
        try:
            import zero_strategy  # noqa: F401 - registers into the registry just created
        except ImportError:
            pass  # uninstalled since start-up: Lightning works as without the hook
        except Exception as err:  # never break `import lightning` for the user
            import warnings

            warnings.warn(f"zero_strategy's Lightning auto-registration failed ({type(err).__name__}: {err}); "
                          "`import zero_strategy` in your script to see the error", RuntimeWarning)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _WATCHED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()
if "zero_strategy" not in sys.modules:
    sys.meta_path.insert(0, _FINDER)
