"""Reading a stage-3 parameter outside forward/backward is correct or loud, never a plausible zero.

At rest a sharded parameter keeps its true shape, numel, dtype and device (so
``model.device``, ``num_parameters()``, shape checks and summaries stay right) but holds
no memory: its values read as NaN and an in-place write raises. Oracle: the same model
before setup (shapes, counts, device) and torch's own NaN semantics. Inside
``gathered_parameters`` the values are the real ones.
"""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from _models import TinyLM, param_groups, tiny_llama_config


def _stage3(model):
    return zs.setup(model, torch.optim.AdamW(param_groups(model)),
                    zs.ZeroConfig(stage=3, param_persistence_threshold=0))[0]


def test_shapes_counts_and_device_stay_true_at_rest():
    torch.manual_seed(0)
    plain = TinyLM(layers=2)
    expected = {n: (p.shape, p.numel(), p.dtype, p.device) for n, p in plain.named_parameters()}
    model = _stage3(plain)
    got = {n: (p.shape, p.numel(), p.dtype, p.device) for n, p in model.named_parameters()}
    assert got == expected
    assert all(p.untyped_storage().nbytes() <= p.element_size() for p in model.parameters())


def test_a_value_read_at_rest_is_nan_not_zero():
    torch.manual_seed(0)
    plain = TinyLM(layers=2)
    true_sum = sum(p.sum() for p in plain.parameters()).item()
    model = _stage3(plain)
    assert true_sum != 0.0
    assert torch.isnan(sum(p.sum() for p in model.parameters()))  # was a silent 0.0
    with zs.gathered_parameters(model):
        assert sum(p.sum() for p in model.parameters()).item() == pytest.approx(true_sum, rel=1e-6)


def test_an_in_place_write_at_rest_raises():
    model = _stage3(TinyLM(layers=2))
    with torch.no_grad(), pytest.raises(RuntimeError, match="single memory location"):
        model.layers[0].fc1.weight.copy_(torch.ones_like(model.layers[0].fc1.weight))


def test_hugging_face_counts_and_device_at_rest():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(tiny_llama_config())
    count, device, dtype = plain.num_parameters(), plain.device, plain.dtype
    model = _stage3(plain)
    assert (model.num_parameters(), model.device, model.dtype) == (count, device, dtype)
