"""The tiny causal LM and token dataset the HF Trainer workers train (tests/workers/accelerate_hf_trainer.py,
tests/workers/trainer_subclass_resume.py): a 2-layer Llama from its config and fixed random token rows,
the same on every rank, so two runs from one seed are comparable step by step."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ, EXAMPLES = 64, 16, 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (EXAMPLES, SEQ), generator=torch.Generator().manual_seed(5))

    def __len__(self):
        return EXAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                        tie_word_embeddings=False))
