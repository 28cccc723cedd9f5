"""The tiny Llama and the LoRA the PEFT tests train, shared by workers and the tests that reload."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64


def tiny_llama(vocab: int = VOCAB) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(3)
    return LlamaForCausalLM(cfg)


def lora(model: LlamaForCausalLM):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


def batch(step: int, rank: int, vocab: int = VOCAB, rows: int = 2) -> torch.Tensor:
    """Rank ``rank``'s micro-batch of step ``step`` (every rank can make every rank's)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, vocab, (rows, 12), generator=g)
