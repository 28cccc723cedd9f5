"""The activation estimate with the tiled loss, and what ``estimate_memory`` / ``zero_auto`` do with it.

Oracles independent of the formula: the bytes autograd saves, measured through
``saved_tensors_hooks`` on a tiny Llama set up with ``tiled_loss`` (as tests/test_estimate_activations.py
measures the untiled model); ``estimate_memory`` without activations plus the activations given; and
``choose_preset`` on a machine whose device fits the model states but not them. The estimate of the
whole peak against the process's own memory: tests/test_tiled_loss_memory.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_strategy as zs
from zero_strategy import AvailableMemory, choose_preset, estimate_memory
from zero_strategy.estimate import estimate_activations

from _models import saved_storages

transformers = pytest.importorskip("transformers")

GIB = 2**30


def _saved_bytes(model, b: int, s: int, vocab: int) -> int:
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(b * s))
    with saved_storages(model) as storages:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert loss.requires_grad
    return sum(storages.values())


@pytest.mark.parametrize("b,s", [(1, 8), (2, 16), (3, 40)])
def test_tiled_saved_bytes_match_the_formula(b, s):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    model, _ = zs.setup(model, None, {"stage": 1, "tiled_loss": 4})
    measured = _saved_bytes(model, b, s, 256)
    tiled = estimate_activations(config, b, s, "fp32", "sdpa", tiled_loss=4)
    untiled = estimate_activations(config, b, s, "fp32", "sdpa")
    assert abs(tiled.without_checkpointing - measured) <= 8 * b, (tiled.without_checkpointing, measured)
    assert untiled.outside - tiled.outside == 4 * b * s * 256  # exactly the fp32 log-softmax of the logits
    zs.teardown(model)


def test_the_peak_falls_with_tiling_and_with_the_chunk():
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                      num_hidden_layers=32, vocab_size=128256)
    untiled = estimate_activations(config, 1, 32768, "bf16", "sdpa")
    tiled = estimate_activations(config, 1, 32768, "bf16", "sdpa", tiled_loss=True)
    small = estimate_activations(config, 1, 32768, "bf16", "sdpa", tiled_loss=64)
    logits = 32768 * 128256 * 2
    assert untiled.peak_with_checkpointing - tiled.peak_with_checkpointing > 4 * logits
    assert small.peak_without_checkpointing < tiled.peak_without_checkpointing
    assert tiled.tiled_loss == 64 * 2**20 // (4 * 128256) and untiled.tiled_loss is None


def test_estimate_memory_adds_the_activations_to_the_device_peak():
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    bare = estimate_memory(model, stage=3, world_size=2)
    given = estimate_memory(model, stage=3, world_size=2, activations=3 * GIB)
    assert given.peak_device == bare.peak_device + 3 * GIB
    assert given.peak_host == bare.peak_host and given.total_device == bare.total_device
    sweep = estimate_memory(model, world_size=2, activations=GIB)
    assert all(e.activations == GIB for e in sweep)


def test_zero_auto_chooses_by_the_activations_it_is_given():
    """A device that holds zero3's model states and a long sequence's untiled loss, but not zero2's
    (which holds more) with that loss: counted, the activations push the choice from zero2 to zero3;
    tiled, zero2 fits again."""
    with torch.device("meta"):
        model = nn.ModuleDict({"layers": nn.ModuleList(nn.Linear(2048, 2048, bias=False) for _ in range(8))})
    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5504, num_attention_heads=16,
                                      num_hidden_layers=8, vocab_size=128256)
    untiled = estimate_activations(config, 1, 16384, "bf16", "sdpa").peak_with_checkpointing
    tiled = estimate_activations(config, 1, 16384, "bf16", "sdpa", tiled_loss=True).peak_with_checkpointing
    zero3 = estimate_memory(model, stage=3, world_size=4, precision="bf16").peak_device
    device = int((zero3 + untiled) / 0.75) + 1
    mem = AvailableMemory(device=device, host=1024 * GIB, nvme=None)
    choose = lambda acts: choose_preset(model, {"preset": "zero_auto", "precision": "bf16"}, world_size=4,  # noqa: E731
                                        available=mem, activations=acts).stage
    assert choose(0) == 2
    assert choose(tiled) == 2
    assert choose(untiled) == 3
