"""``python -m zero_strategy.lightning install-autoregister | uninstall-autoregister``.

Opt-in: makes ``Trainer(strategy="zero3")`` work without ``import zero_strategy``, by
writing ``zero_strategy_lightning.pth`` into this environment's site-packages.
Lightning has no discovery mechanism for strategies (its only entry-point group is for
callbacks, read after the strategy flag is resolved; see ``_registry.py``), so a ``.pth``
line is the one way to run code before the user's script.

[Note: the .pth line survives the package]
The line stores no path: at interpreter start it asks the import system where
``zero_strategy`` is now (``importlib.util.find_spec``, which imports nothing) and runs
that copy's ``lightning/_autoregister_hook.py`` (standard library only, no torch). When the
package is uninstalled or moved away, or the hook file is gone, the line does nothing and
prints nothing; it never raises, because an exception in a ``.pth`` line is printed at
every Python start in the environment.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

PTH = "zero_strategy_lightning.pth"

# Runs in site.py's namespace, so everything stays inside one function that deletes itself.
_LOADER = """
def _zero_strategy_autoregister():
    try:
        import importlib.util, os
        spec = importlib.util.find_spec("zero_strategy")
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            hook = os.path.join(root, "lightning", "_autoregister_hook.py")
            if os.path.isfile(hook):
                hook_spec = importlib.util.spec_from_file_location("_zero_strategy_autoregister_hook", hook)
                hook_spec.loader.exec_module(importlib.util.module_from_spec(hook_spec))
                return
    except Exception:
        return
_zero_strategy_autoregister()
del _zero_strategy_autoregister
"""


def pth_text() -> str:
    """The one line of the .pth file (site.py executes lines that start with ``import``)."""
    return f"import sys; exec({_LOADER!r})\n"


def install(site_dir: Path) -> Path:
    target = Path(site_dir) / PTH
    target.write_text(pth_text())
    return target


def uninstall(site_dir: Path) -> Path:
    target = Path(site_dir) / PTH
    target.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    site_dir = Path(sysconfig.get_paths()["purelib"])
    if argv == ["install-autoregister"]:
        print(f"wrote {install(site_dir)}")
        return 0
    if argv == ["uninstall-autoregister"]:
        print(f"removed {uninstall(site_dir)}")
        return 0
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
