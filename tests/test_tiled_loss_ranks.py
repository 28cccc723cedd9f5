"""The tiled loss at stages 1-3 on 2 gloo ranks trains like one process on the whole data.

At stage 3 the untied head is a unit of its own, so its weight exists only between the gather
and release hooks of its module: the tiled loss runs inside the head's forward and its
recomputation after the head's pre-backward gather (See [Note: the head runs as a module] in
src/zero_strategy/_model/tiled_loss.py). One rank's labels are all -100 at one step: its loss is 0
and it adds nothing to the gradient, never NaN. Oracle: tests/workers/tiled_loss.py's reference,
the model not set up, trained in one process with transformers' own loss on both ranks' batches.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

from _launch import launch_cases  # noqa: E402

CASES = [
    {"name": "stage1", "stage": 1},
    {"name": "stage2", "stage": 2},
    {"name": "stage3", "stage": 3},
    {"name": "stage3_cpu_offload", "stage": 3, "config": {"offload_optimizer": "cpu", "offload_params": "cpu"}},
    {"name": "stage3_checkpointing", "stage": 3, "checkpointing": True},
]


@functools.lru_cache(maxsize=None)
def results():
    return launch_cases("tiled_loss.py", 2, CASES, key=lambda r: r["case"], timeout=400)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_two_ranks_train_like_one_process_on_the_whole_data(case):
    for rank, res in enumerate(results().of(case)):
        assert res["losses"] == pytest.approx(res["ref_losses"], rel=1e-5, abs=1e-7), rank
        assert res["weight_rel_diff"] < 1e-5, (rank, res["weight_rel_diff"])
    assert results().of(case)[1]["losses"][1] == 0.0  # the rank whose labels were all -100


@pytest.mark.multiprocess
def test_the_head_is_a_stage3_unit_of_its_own():
    """What makes the stage-3 cases meaningful: the head's weight is gathered only around its module."""
    assert "lm_head" in results().of("stage3")[0]["units"]
