"""Gradient accumulation communicates only at the boundary where the stage allows it.

Two micro-batches per step, 2 ranks, Psi_t trainable elements:
* stage 1 reduce-scatters once per step at ``optimizer.step()``, with or without
  ``no_sync``: Psi_t.
* stages 2-3 inside ``no_sync`` keep full gradients and reduce on the last
  micro-batch only: Psi_t; without it they reduce every micro-batch: 2 Psi_t.
Parameter all-gathers are unaffected (once after the step for stages 1-2).
"""

from __future__ import annotations

import pytest

from _accounting import accounting_accumulation


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage,no_sync,reductions", [
    (1, True, 1), (1, False, 1), (2, True, 1), (2, False, 2), (3, True, 1), (3, False, 2)])
def test_reduce_scatter_volume_per_step(stage, no_sync, reductions):
    for rank, res in enumerate(accounting_accumulation(2)[(stage, no_sync)]):
        psi = res["counts"]["trainable"]
        assert res["comm"]["reduce_scatter"]["volume_elements"] == pytest.approx(reductions * psi, rel=0.01)
