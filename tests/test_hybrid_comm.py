"""Hybrid sharding's bytes per step, inside and across shard groups, equal the theory (issue #15).

4 gloo ranks as 2 shard groups of 2 (tests/workers/hybrid_comm.py). Elements are
counted at the torch call (patched ``torch.distributed`` functions), not by the engine's
counters, and compared with the theory for a trainable count Ψ and frozen count Φ
(padding adds at most k-1 elements per flat group: 1% slack):

* inside a group (k ranks): reduce-scatter Ψ; all-gather Ψ (stages 1-2: the updated
  parameters) or 2(Ψ+Φ) - ρ (stage 3: forward and backward, except the root unit's ρ
  parameters outside the blocks, gathered once: it stays gathered through backward);
* across groups (R = N/k replicas): all-reduce of this rank's gradient shard, Ψ/k
  elements, sent 2(R-1)/R times in a ring.

``comm_stats`` must report the same, with inter-group bytes separately.
"""

from __future__ import annotations

import functools

import pytest

from _launch import launch

K, N = 2, 4
R = N // K


@functools.lru_cache(maxsize=None)
def results() -> list[dict]:
    return launch("hybrid_comm.py", N, {"k": K}, timeout=200)


def close(a: float, b: float, rel: float = 0.01) -> bool:
    return abs(a - b) <= rel * b


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_inside_and_across_groups_equal_theory(stage):
    for rank, rep in enumerate(results()):
        res = next(r for r in rep["results"] if r["stage"] == stage)
        assert (res["shard_world"], res["replicas"]) == (K, R)
        psi, phi, c = res["trainable"], res["frozen"], res["counted"]
        assert close(c["intra_reduce_scatter"], psi), (rank, c, psi)
        gathered = 2 * (psi + phi) - res["root"] if stage == 3 else psi
        assert close(c["intra_all_gather"], gathered), (rank, c, gathered)
        assert close(c["inter_all_reduce"], psi / K), (rank, c, psi / K)
        stats = res["stats"]
        assert stats["inter_all_reduce"]["volume_elements"] == c["inter_all_reduce"]
        assert stats["inter_group_sent_bytes"] == int(c["inter_all_reduce"] * 4 * 2 * (R - 1) / R)
        intra = c["intra_reduce_scatter"] + c["intra_all_gather"]
        assert stats["reduce_scatter"]["volume_elements"] + stats["all_gather"]["volume_elements"] == intra
