"""Messages the engine emits for the Lightning front ends appear once per job, as Lightning's own do.

The engine warns (``warnings.warn``) and logs (``logging.getLogger("zero_strategy...")``)
on every rank, since it cannot know who reads the output. Inside the Lightning front ends
the same lines would print once per process, unlike Lightning's ``rank_zero_warn`` /
``rank_zero_info``. So the strategy runs config loading, setup and checkpoint loading
inside :func:`on_rank_zero`: on rank 0 the warnings are re-emitted unchanged (category,
location, the user's warning filters apply as usual); on the other ranks they are dropped
and ``zero_strategy`` log records below ERROR are not emitted. Errors are never hidden.
"""

from __future__ import annotations

import contextlib
import logging
import warnings


def _rank() -> int:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) or 0


@contextlib.contextmanager
def on_rank_zero():
    logger = logging.getLogger("zero_strategy")
    on_zero = _rank() == 0
    level = logger.level
    if not on_zero:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        if not on_zero:
            logger.setLevel(level)
    if on_zero:
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
