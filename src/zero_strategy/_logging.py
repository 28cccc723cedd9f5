"""Rank-0-only log records: a line that every rank would print identically is printed once.

[Note: which rank logs]
Configuration facts (the config a front end chose, the ds_config sections it drops) are
the same on every rank, and N copies of each line hide the one that differs. Loggers
that carry such lines get :class:`RankZeroFilter`: a record passes on global rank 0
(``torch.distributed``'s rank once the process group exists, else the launcher's
``RANK``, else 0), on every rank when ``ZERO_STRATEGY_LOG_ALL_RANKS=1``, and always at
ERROR and above. Lines that are about one rank (its swap file, its device) are logged
on loggers without the filter.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

ALL_RANKS_ENV = "ZERO_STRATEGY_LOG_ALL_RANKS"


def global_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankZeroFilter(logging.Filter):
    """Pass a record on rank 0 only (see [Note: which rank logs])."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        if os.environ.get(ALL_RANKS_ENV, "").strip().lower() in ("1", "true", "yes"):
            return True
        return global_rank() == 0


def rank_zero_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with one :class:`RankZeroFilter` attached."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RankZeroFilter) for f in logger.filters):
        logger.addFilter(RankZeroFilter())
    return logger
