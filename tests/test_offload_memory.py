"""With CPU offload the memory report shows optimizer state off the compute device,
and both sides stay at the formula.

Reference: ``estimate_memory(..., offload_optimizer="cpu"[, offload_params="cpu"],
device="cpu")``: host holds the fp32 master + optimizer state (K Psi/N) and an fp32
gradient shard for the CPU step (4 Psi/N), plus the parameter shard with parameter
offload; on this CUDA-less machine an fp32 master is the parameter shard and fp32
gradient shards are stepped in place, so neither copy exists; the device
keeps the parameters (stages 1-2 whole, stage 3 nothing at rest with parameter
offload) and the reduced gradient shard. Staging buffers for uploads are bounded:
two slots of the largest shard, whatever the model size.
"""

from __future__ import annotations

import pytest

import zero_strategy as zs
from _accounting import OFFLOAD_CASES, _offload_key, accounting_offload


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("case", OFFLOAD_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_offloaded_state_is_on_the_host_and_matches_the_formula(world_size, case):
    for rank, res in enumerate(accounting_offload(world_size)[_offload_key(case)]):
        n = res["counts"]
        est = zs.estimate_memory(n["trainable"], frozen_params=n["frozen"], world_size=world_size,
                                 stage=case["stage"], precision=case["precision"], optimizer="adamw",
                                 offload_optimizer="cpu", offload_params=case.get("offload_params"),
                                 device="cpu")
        device, host = res["placement"]["device"], res["placement"]["host"]
        # nothing of the optimizer on the device
        assert device["master"] == 0 and device["optimizer_state"] == 0, device
        assert host["optimizer_state"] > 0
        host_state = host["master"] + host["optimizer_state"] + host["grads"] + host["params"]
        assert host_state == pytest.approx(est.host_optimizer + est.host_grads + est.host_params, rel=0.05)
        assert device["params"] + device["grads"] == pytest.approx(est.device_params + est.device_grads,
                                                                   rel=0.05)
        bytes_per_elem = 4 if case["precision"] == "fp32" else 2
        assert host["staging"] <= 2 * res["largest_shard"] * bytes_per_elem
