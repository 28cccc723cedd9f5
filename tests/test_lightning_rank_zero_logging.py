"""Lines the Lightning front end prints appear once per job, on rank 0, like Lightning's own.

Reference: Lightning's own rank-zero lines in the same run ("GPU available: ...",
"`Trainer.fit` stopped: ..."), which Lightning prints on rank 0 only. The engine's warning (stage 3
found no units), its INFO log line (DeepSpeed keys accepted without effect) and the
front end's warning (a DeepSpeedStrategy argument with no effect) must do the same.
"""

from __future__ import annotations

import pytest

from _launch import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

LINES = {
    "lightning's own": "GPU available:",
    "lightning's own at the end": "`Trainer.fit` stopped",
    "engine warning": "found no repeated blocks",
    "engine log": "accepted without effect on ZeRO",
    "front-end warning": "overlap_comm: communication is always overlapped",
}


def test_each_line_is_printed_by_rank_zero_only(tmp_path):
    reports = launch("lightning_logging.py", 2, {}, timeout=180, out=tmp_path)
    assert [r["global_step"] for r in reports] == [2, 2]
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(2)]
    counts = {what: [log.count(text) for log in logs] for what, text in LINES.items()}
    assert counts["lightning's own"][0] >= 1 and counts["lightning's own"][1] == 0, counts  # the reference holds
    for what in LINES:
        assert counts[what][0] >= 1 and counts[what][1] == 0, (what, counts)
