"""An untied tiny Llama at stage 3 on 2 ranks, one training step per layout: auto-detected units
(embeddings and head units of their own) and the blocks named by ``unit_classes`` (embeddings and
head in the root, the layout before). Reports the engine's peaks of gathered bytes and gradient
buckets per layout (tests/test_large_root_units.py)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from _worker import finish, start

import zero_strategy as zs

VOCAB = 8000


def peaks(unit_classes: list[str]) -> dict:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=6, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                                         tie_word_embeddings=False, use_cache=False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = zs.ZeroConfig(stage=3, unit_classes=unit_classes, param_persistence_threshold=0)
    model, optimizer = zs.setup(model, optimizer, config)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    zs.memory_report(model, reset_peak=True)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    peak = zs.memory_report(model).peak_working_set
    return {"units": [u.name for u in zs.api._engine_of(model).units], "gathered": peak["gathered"],
            "grad_buckets": peak["grad_buckets"]}


def main() -> None:
    args, out = start()
    finish(out, {"auto": peaks([]), "root": peaks(["LlamaDecoderLayer"]), "vocab": VOCAB})


if __name__ == "__main__":
    main()
