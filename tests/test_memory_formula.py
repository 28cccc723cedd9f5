"""Per-rank model-state bytes the engine holds equal the ZeRO formula (within 5%).

Measured: every tensor the engine and the optimizer hold after a backward
(parameters, gradients, fp32 masters, Adam moments), each storage counted once.
Reference: ``estimate_memory``, the ZeRO paper's formula (stage 1: (P+G)Psi + K Psi/N,
stage 2: P Psi + (G+K) Psi/N, stage 3: (P+G+K) Psi/N; P, G = parameter and gradient
bytes, K = fp32 master (when P < 4) + 8 bytes of Adam moments), fed with parameter
counts taken from the unsharded model.
"""

from __future__ import annotations

import pytest

from _accounting import CASES, accounting
import zero_strategy as zs


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage,precision", [(c["stage"], c["precision"]) for c in CASES])
def test_model_state_bytes_match_formula(world_size, stage, precision):
    for rank, res in enumerate(accounting(world_size)[(stage, precision)]):
        n = res["counts"]
        est = zs.estimate_memory(n["trainable"], frozen_params=n["frozen"], world_size=world_size,
                                 stage=stage, precision=precision, optimizer="adamw")
        mem = res["memory"]
        measured_total = sum(mem.values())
        assert measured_total == pytest.approx(est.total_device, rel=0.05), (rank, mem, est)
        assert mem["params"] == pytest.approx(est.device_params, rel=0.05), (rank, mem, est)
        assert mem["grads"] == pytest.approx(est.device_grads, rel=0.05), (rank, mem, est)
        assert mem["master"] + mem["optimizer_state"] == pytest.approx(est.device_optimizer, rel=0.05)


@pytest.mark.multiprocess
def test_sharding_shrinks_memory_with_more_ranks():
    """Stage 3 holds about half per rank at 4 ranks what it holds at 2."""
    two = sum(accounting(2)[(3, "fp32")][0]["memory"].values())
    four = sum(accounting(4)[(3, "fp32")][0]["memory"].values())
    assert four == pytest.approx(two / 2, rel=0.05)
