"""The activation formula of a Llama-style decoder against the bytes autograd really saves.

Measurement (independent of the formula): run forward with ``use_cache=False`` and the
loss under ``torch.autograd.graph.saved_tensors_hooks``, and add the bytes of every
distinct storage a saved tensor lives in, parameters excluded. That is activation memory
by definition: what forward keeps alive for backward. (The CPU allocator keeps no
statistics, so there is no allocator peak to read.)

Tolerance: 8 bytes per sequence. The formula (see [Note: activation memory of a
Llama-style decoder] in _estimate_activations.py) counts each saved tensor; the only term it does not
pin down is whether the shifted labels are a copy (8bs bytes, b > 1) or a view of the
padded labels (8b(s + 1), b = 1); it counts the latter. Cases: fp32 and bf16, eager and
SDPA attention, grouped-query (2 of 4 heads) and full attention, three (b, s) shapes from
1 x 8 to 3 x 40 (so the as²b terms vary independently of the sbh terms), with and
without gradient checkpointing.
"""

from __future__ import annotations

import pytest
import torch

from zero_strategy.estimate import estimate_activations

from _models import saved_storages

transformers = pytest.importorskip("transformers")

SHAPES = [(1, 8), (2, 16), (3, 40)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tiny_llama(attention: str, kv_heads: int, layers: int = 2):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=kv_heads,
                                      attn_implementation=attention)
    torch.manual_seed(0)
    return config, transformers.AutoModelForCausalLM.from_config(config)


def saved_bytes(model, b: int, s: int) -> int:
    ids = torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(b * s))
    with saved_storages(model) as storages:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    assert loss.requires_grad
    return sum(storages.values())


@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_formula_matches_saved_tensor_bytes(precision, attention, kv_heads):
    config, model = tiny_llama(attention, kv_heads)
    model = model.to(DTYPES[precision]).train()
    for b, s in SHAPES:
        measured = saved_bytes(model, b, s)
        estimate = estimate_activations(config, b, s, precision, attention).without_checkpointing
        assert abs(estimate - measured) <= 8 * b, (b, s, estimate, measured)


@pytest.mark.parametrize("precision", list(DTYPES))
def test_with_checkpointing_each_layer_keeps_only_its_input(precision):
    """HF ``gradient_checkpointing_enable()`` (reentrant, one checkpoint per layer): forward keeps
    each layer's input, the outside part, and the rotary tables as a Python argument of the
    checkpoint (alive, but not a saved tensor: the measurement does not see them). The backward
    peak adds one recomputed layer on top (``with_checkpointing``)."""
    config, model = tiny_llama("sdpa", 2, layers=3)
    model = model.to(DTYPES[precision]).train()
    model.gradient_checkpointing_enable()
    for b, s in SHAPES:
        est = estimate_activations(config, b, s, precision, "sdpa")
        kept = est.layers * est.layer_input + est.outside - est.rotary
        assert abs(kept - saved_bytes(model, b, s)) <= 8 * b, (b, s)
        assert est.with_checkpointing == kept + est.rotary + est.per_layer


def test_at_llama_2_scale_checkpointing_keeps_one_bf16_hidden_state_per_layer():
    """Llama-2-7B shapes (h 4096, 32 heads, 32 layers), bf16, 8 x 4096 tokens per rank: with
    checkpointing a layer keeps its bf16 input (2sbh bytes: 256 MiB here), and the run's peak
    falls more than tenfold, as Korthikanti et al. report for full recomputation."""
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                      num_hidden_layers=32, vocab_size=32000)
    est = estimate_activations(config, 8, 4096, "bf16", "eager")
    assert est.layer_input == 2 * 8 * 4096 * 4096 == 256 * 2**20
    assert est.with_checkpointing < est.without_checkpointing / 10


def test_other_architectures_are_refused_with_the_reason():
    gpt2 = transformers.GPT2Config()
    with pytest.raises(ValueError, match="Llama-style decoders"):
        estimate_activations(gpt2, 1, 8)
