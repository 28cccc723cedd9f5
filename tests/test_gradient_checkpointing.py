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

from _checkpointing import CASES, CheckpointedLM, case_id, results_of  # noqa: E402

# one launch of every case, about 11 s: the full tier (docs/testing.md, "Tiers"); the default tier
# keeps checkpointing under compile (test_compile_parity.py)
pytestmark = pytest.mark.slow



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
    steps = len(res["losses_zero"])
    assert steps >= 2
    expected = steps * case["calls"] if case["ckpt"] else 0
    assert res["recomputes"] == expected


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [c for c in CASES if c["stage"] == 3], ids=case_id)
def test_stage3_units_released_after_backward(case):
    """The recompute's gathers are released with the unit's backward: nothing stays gathered."""
    for res in results_of(case):
        assert res["gathered_after_backward"] == []


def test_overlap_step_refuses_a_second_round_of_reentrant_gradients():
    """overlap_step steps a group on the CPU as soon as it is reduced; a unit called twice
    under reentrant checkpointing brings its gradients once per call, after that step.
    That cannot be exact, so it raises and names the fix (one process, the same code path)."""
    import torch

    import zero_strategy as zs
    from _models import batch, loss_fn

    torch.manual_seed(0)
    model = CheckpointedLM(reentrant=True)
    model, zopt = zs.setup(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                           zs.ZeroConfig(stage=2, offload_optimizer="cpu", overlap_step=True))
    tokens, targets = batch(0, 0, 0)
    loss = loss_fn(model(tokens), targets) + loss_fn(model(tokens), targets)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        loss.backward()
    zs.reset_iter_state(model)
