"""Large modules outside the repeated blocks (untied embeddings, an LM head) are units of their
own, so stage 3 no longer holds them gathered, with their gradients, from the start of forward to
the end of backward. See [Note: large modules outside the blocks] in _engine/units.py.

What stays in the root, as before: tied embeddings (a parameter with two users), a module
registered under two names (T5's ``shared``), containers, modules under half the largest block,
and everything when ``unit_classes`` names the units. Training equal to DDP with the new units is
tests/test_transformers_llama.py (untied, stages 1-3, and ``generate()``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration  # noqa: E402

from _launch import launch  # noqa: E402

from zero_strategy._engine.units import find_unit_modules  # noqa: E402


def llama(tied: bool, vocab: int = 2000) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=vocab,
                                        tie_word_embeddings=tied, use_cache=False))


def units_of(model: nn.Module, unit_classes: tuple[str, ...] = ()) -> list[str]:
    return [name for name, _ in find_unit_modules(model, unit_classes)]


def test_untied_embeddings_and_head_are_units_in_the_order_forward_runs_them():
    assert units_of(llama(tied=False)) == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                           "model.layers.2", "lm_head"]


def test_tied_embeddings_stay_in_the_root():
    assert units_of(llama(tied=True)) == ["model.layers.0", "model.layers.1", "model.layers.2"]


def test_a_module_registered_under_two_names_stays_in_the_root():
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(2)])
    model = nn.Module()
    model.embed, model.blocks = nn.Embedding(100, 32), blocks
    model.decoder_embed = model.embed  # one module, two names (T5's shared embeddings in transformers 4)
    assert units_of(model) == ["blocks.0", "blocks.1"]


def test_t5s_shared_embeddings_stay_in_the_root():
    t5 = T5ForConditionalGeneration(T5Config(num_layers=2, d_model=64, d_ff=128, num_heads=4, d_kv=16, vocab_size=4000))
    units = units_of(t5)
    assert t5.shared.weight is t5.encoder.embed_tokens.weight  # one parameter, several modules using it
    assert not {"shared", "encoder.embed_tokens", "decoder.embed_tokens"} & set(units)
    assert ("lm_head" in units) == (t5.lm_head.weight is not t5.shared.weight)  # a tied head stays too


def test_small_modules_and_containers_stay_in_the_root():
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)])
    model = nn.Module()
    model.blocks, model.head = blocks, nn.Linear(32, 4)  # 132 elements against a block's 1056
    model.adapters = nn.ModuleList([nn.Linear(32, 32)])  # a container (its one child is a unit: a list)
    model.big = nn.Linear(32, 40)  # 1320 elements: larger than half a block
    assert units_of(model) == ["blocks.0", "blocks.1", "blocks.2", "adapters.0", "big"]


def test_unit_classes_name_the_units_exactly():
    assert units_of(llama(tied=False), ("LlamaDecoderLayer",)) == ["model.layers.0", "model.layers.1", "model.layers.2"]


@pytest.mark.multiprocess
def test_stage3_no_longer_holds_embeddings_and_head_for_the_whole_step():
    """2 ranks, one step, against the layout before (the same blocks named by ``unit_classes``:
    embeddings and head in the root): the engine's gathered window and its gradient buckets each
    lose at least one of the two whole (the 8000 x 64 embeddings and head are 81% of this 6-layer model)."""
    for rank in launch("large_root_units.py", 2, {}, timeout=120):
        auto, root = rank["auto"], rank["root"]
        assert auto["units"][1] == "model.embed_tokens" and auto["units"][-1] == "lm_head"
        one_whole = rank["vocab"] * 64 * 4  # fp32 bytes of the embeddings (or the head), gathered
        assert auto["gathered"] <= root["gathered"] - one_whole, (auto, root)
        assert auto["grad_buckets"] <= root["grad_buckets"] - one_whole, (auto, root)
