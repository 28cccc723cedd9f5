"""Gradient checkpointing trains exactly like DDP without it, at stages 1 to 3.

Hugging Face ``gradient_checkpointing_enable()`` (reentrant and non-reentrant) on a tiny
Llama, full fine-tune and LoRA through peft; ``torch.utils.checkpoint.checkpoint`` around
each block of a plain model, full and with a frozen base (no trainable parameter in the
root unit); the model called once or twice per iteration. Stage 3 shards everything
(``param_persistence_threshold=0``). The reference is DDP without checkpointing on the
same batches (tests/workers/grad_checkpointing.py). One launch runs every case.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from _checkpointing import CASES, case_id, results_of  # noqa: E402



@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_losses_and_weights_equal_ddp(case):
    for rank, res in enumerate(results_of(case)):
        assert res["losses_zero"] == pytest.approx(res["losses_ref"], rel=1e-5), (rank, res["losses_zero"])
        assert res["weight_rel_diff"] < 1e-5, (rank, res["worst"], res["weight_rel_diff"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_checkpointing_really_recomputes(case):
    """The first block's MLP runs again inside backward once per call and step, and only
    with checkpointing on: the cases above are checkpointed, not silently plain."""
    res = results_of(case)[0]
    expected = 3 * case["calls"] if case["ckpt"] else 0  # 3 steps
    assert res["recomputes"] == expected


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [c for c in CASES if c["stage"] == 3], ids=case_id)
def test_stage3_units_released_after_backward(case):
    """The recompute's gathers are released with the unit's backward: nothing stays gathered."""
    for res in results_of(case):
        assert res["gathered_after_backward"] == []
