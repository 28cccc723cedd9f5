"""Warnings that point at the user's line, however deep in the package they are raised.

A warning about a setup choice (no units found, a parameter in no optimizer, a 4-bit base left
whole) is raised several calls below the user's ``setup(...)``; a fixed ``stacklevel`` counts
those calls and goes stale the day one of them is split in two (it did: ``setup`` now calls
``_setup``), and the warning then names a line of ours. :func:`warn_at_user` counts instead:
its stack level is that of the first frame outside this package, which is the call the user
wrote (or the front end's, for a user of a front end, which is still not ours to fix).
"""

from __future__ import annotations

import sys
import warnings

_PACKAGE = __name__.split(".")[0]


def warn_at_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the first caller outside the package."""
    frame, level = sys._getframe(1), 2  # stacklevel 2 is our caller; each frame of ours adds one
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == _PACKAGE:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
