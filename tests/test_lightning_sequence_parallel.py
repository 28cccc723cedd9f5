"""``Trainer(strategy=ZeroStrategy(stage=..., sequence_parallel_size=2))`` trains a Hugging Face model
exactly like one process on the whole sequences: the strategy samples the data over the
data-parallel ranks and hands ``training_step`` this rank's shard.

Issue 40. tests/workers/lightning_sequence_parallel.py: a LightningModule holding a tiny Llama,
a DataLoader of whole samples (a prompt masked with -100), ``training_step`` returning
``zero_strategy.sequence_parallel_loss``; the reference trains a copy in one process in the
order Lightning's sampler gives, with torch's SGD and ``clip_grad_norm_``. Fabric's case:
``ZeroFabricStrategy(sequence_parallel_size=2)``, ``fabric.setup_dataloaders`` and
``zero_strategy.shard_sequence`` in the loop.
"""

from __future__ import annotations

import functools

import pytest

from _launch import launch

TOL = 1e-5
CASES = [dict(name="stage3", stage=3), dict(name="stage2-accumulate-clip", stage=2, accumulate=2, clip=0.05),
         dict(name="fabric-stage3", stage=3, fabric=True)]


@functools.lru_cache(maxsize=None)
def results() -> dict:
    return launch("lightning_sequence_parallel.py", 2, {"cases": CASES}, timeout=400)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("name", [c["name"] for c in CASES])
def test_trainer_fit_with_sequence_parallelism_matches_one_process(name):
    for rank, report in enumerate(results()):
        res = report[name]
        assert "error" not in res, f"rank {rank}: {res.get('trace', res['error'])}"
        for step, (got, want) in enumerate(zip(res["losses"], res["ref_losses"], strict=True)):
            assert abs(got - want) <= TOL * abs(want), f"rank {rank} step {step}: {got} vs one process {want}"
        assert res["weight_rel_diff"] <= TOL, res["weight_rel_diff"]
