"""``python -m zero_strategy.lightning install-autoregister | uninstall-autoregister``.

Opt-in: makes ``Trainer(strategy="zero3")`` work without ``import zero_strategy``, by
writing ``zero_strategy_lightning.pth`` into this environment's site-packages. The
.pth runs ``_autoregister_hook.py`` at interpreter start (a few imports from the
standard library, no torch); Lightning's strategy registries then trigger
``import zero_strategy``. Lightning has no entry-point group for strategies.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

PTH = "zero_strategy_lightning.pth"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    target = Path(sysconfig.get_paths()["purelib"]) / PTH
    if argv == ["install-autoregister"]:
        hook = Path(__file__).with_name("_autoregister_hook.py").resolve()
        target.write_text(f"import runpy; runpy.run_path({str(hook)!r})\n")
        print(f"wrote {target}")
        return 0
    if argv == ["uninstall-autoregister"]:
        target.unlink(missing_ok=True)
        print(f"removed {target}")
        return 0
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
