"""A model created on the meta device is materialized by setup unit by unit: every
rank ends with rank 0's initialization, tied weights stay tied, and training equals
DDP started from the same weights. Parameters nothing can initialize are named."""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from _launch import launch
from _models import TinyLM


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_meta_model_materializes_and_trains_like_ddp(stage):
    for rep in launch("meta_init.py", 2, {"stage": stage}, timeout=120):
        assert rep["ranks_agree"] and rep["tied"] and rep["initialized"]
        for zero, ref in rep["losses"]:
            assert zero == pytest.approx(ref, rel=1e-5)
        assert rep["weight_diff"] < 1e-5


def test_parameters_without_an_initializer_are_named():
    with torch.device("meta"):
        model = TinyLM(layers=2)
    with pytest.raises(ValueError, match=r"frozen_mix.*param_init_fn"):
        zs.setup(model, None, "zero3")


def test_stage3_meta_model_holds_only_shards_after_setup():
    with torch.device("meta"):
        model = TinyLM(layers=2)
    model, _ = zs.setup(model, None, zs.ZeroConfig(stage=3, param_persistence_threshold=0),
                        param_init_fn=lambda m: m.reset_parameters() if hasattr(m, "reset_parameters")
                        else [p.data.zero_() for p in m.parameters(recurse=False)])
    assert all(p.untyped_storage().nbytes() <= p.element_size() and not p.is_meta
               for p in model.parameters())  # at rest: nothing materialized
    assert not any(b.is_meta for b in model.buffers())
