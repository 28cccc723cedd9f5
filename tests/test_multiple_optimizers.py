"""One model, two optimizers over disjoint parameters (a GAN's generator and
discriminator): each ZeroOptimizer steps and zeroes only its own shards, both
checkpoint together, and the run equals DDP with the same two torch optimizers."""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from _launch import launch
from _models import TinyLM


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_alternating_optimizers_match_ddp_across_a_checkpoint(stage):
    for rank, rep in enumerate(launch("multi_optimizer.py", 2, {"stage": stage}, timeout=120)):
        for step, (zero, ref) in enumerate(rep["losses"]):
            assert zero == pytest.approx(ref, rel=1e-5), (rank, step, rep["losses"])
        assert rep["weight_rel_diff"] <= 1e-5


def test_setup_returns_one_zero_optimizer_per_optimizer_in_order():
    model = TinyLM(layers=2)
    a = torch.optim.SGD(model.layers.parameters(), lr=0.1)
    b = torch.optim.Adam(model.embed.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="in no optimizer param group.*final_norm.weight"):
        model, zopts = zs.setup(model, [a, b], "zero2")  # final_norm is in neither optimizer
    assert [z.optimizer for z in zopts] == [a, b]
    assert {id(g) for g in zopts[0].groups}.isdisjoint({id(g) for g in zopts[1].groups})


def test_a_parameter_in_two_optimizers_is_refused():
    model = TinyLM(layers=2)
    a = torch.optim.SGD(model.layers.parameters(), lr=0.1)
    b = torch.optim.SGD(model.layers[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="in optimizers 0 and 1"):
        zs.setup(model, [a, b], "zero2")
