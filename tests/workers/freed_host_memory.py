"""One process trains a small Llama with glibc's allocator at its defaults, as a user's process
runs, and reports its anonymous RSS beside the engine's own accounting (tests/test_freed_host_memory.py).

argv: preset, release_host_memory (1/0), checkpoint directory. Prints one JSON line: after each
of eight optimizer steps, after an evaluation forward (``model.eval()`` and ``torch.no_grad()``) and
after a checkpoint save, the growth of anonymous RSS since before the model was built, the
engine's resting model states (``memory_report().total``) and its peak working set.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from _rss import anon_rss

import zero_strategy as zs


def main(preset: str, release: bool, ckpt: str) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=512, intermediate_size=1408, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=8000, tie_word_embeddings=False, use_cache=False)
    base = anon_rss()
    model = LlamaForCausalLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = zs.ZeroConfig.preset(preset, precision="bf16", release_host_memory=release)
    model, optimizer = zs.setup(model, optimizer, config)
    model.train()

    def sample(phase: str) -> dict:
        report = zs.memory_report(model)
        return dict(phase=phase, growth=anon_rss() - base, accounted=report.total,
                    peak_working_set=report.peak_working_set_bytes)

    samples = []
    for step in range(8):
        # 2 x 8 tokens: what a step frees and takes again is sized by the parameters (bf16 gradients,
        # fp32 master gradients, gathered units); the activations are the small part, and a CPU without
        # native bf16 matrix products (AVX2 only) ran 4 x 128 at ~2 GFLOP/s: 3 minutes per process
        ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        samples.append(sample(f"step {step}"))
    model.eval()  # evaluation after training, as a user's loop does it
    with torch.no_grad():
        ids = torch.randint(0, cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(99))
        model(input_ids=ids, labels=ids)
    samples.append(dict(sample("eval"), eval_logits=ids.numel() * cfg.vocab_size * 4))
    model.train()
    zs.save_checkpoint(ckpt, model, optimizer)
    samples.append(sample("save_checkpoint"))
    print(json.dumps(samples))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1", sys.argv[3])
