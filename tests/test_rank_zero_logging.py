"""Configuration log lines of the Accelerate/HF front ends and the ds_config import print on rank 0 only.

Every rank reads the same config; N copies of a line bury the one that differs. The
filter reads the launcher's ``RANK`` before the process group exists (as here) and the
process group's rank after. ``ZERO_STRATEGY_LOG_ALL_RANKS=1`` shows every rank's lines;
errors are never filtered. The 2-process case (one warning in the combined log of an
``accelerate launch``) is in tests/test_accelerate_deepspeed_config.py.
"""

from __future__ import annotations

import importlib
import logging

import pytest

from zero_strategy import ZeroConfig

DS = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
LOGGERS = ["zero_strategy._config.deepspeed", "zero_strategy.accelerate"]


def _warnings(caplog, monkeypatch, rank: str, all_ranks: str | None = None) -> list[str]:
    monkeypatch.setenv("RANK", rank)
    if all_ranks is None:
        monkeypatch.delenv("ZERO_STRATEGY_LOG_ALL_RANKS", raising=False)
    else:
        monkeypatch.setenv("ZERO_STRATEGY_LOG_ALL_RANKS", all_ranks)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        ZeroConfig.from_deepspeed(DS)
    return [r.getMessage() for r in caplog.records if r.name == "zero_strategy._config.deepspeed"]


def test_rank_zero_logs(caplog, monkeypatch):
    assert any("optimizer" in m for m in _warnings(caplog, monkeypatch, "0"))


def test_other_ranks_are_quiet_by_default(caplog, monkeypatch):
    assert _warnings(caplog, monkeypatch, "1") == []


def test_every_rank_logs_when_asked(caplog, monkeypatch):
    assert any("optimizer" in m for m in _warnings(caplog, monkeypatch, "1", all_ranks="1"))


@pytest.mark.parametrize("name", LOGGERS)
def test_the_modules_loggers_filter_warnings_but_not_errors_on_other_ranks(caplog, monkeypatch, name):
    """The logger as its module left it (importing the module is what attaches the filter)."""
    if name.endswith("accelerate"):
        pytest.importorskip("accelerate")
    importlib.import_module(name)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("ZERO_STRATEGY_LOG_ALL_RANKS", raising=False)
    logger = logging.getLogger(name)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        logger.warning("a config line")
        logger.error("a failure")
    assert [r.getMessage() for r in caplog.records if r.name == name] == ["a failure"]
