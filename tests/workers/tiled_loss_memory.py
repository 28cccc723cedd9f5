"""Peak anonymous RSS of one training step of a long sequence with and without the tiled loss
(tests/test_tiled_loss_memory.py).

A 2-layer Llama (hidden 32) with a ``vocab``-token vocabulary at stage 3, one sequence of
``seq`` tokens, trained by ``outputs = model(input_ids=ids, labels=ids); outputs.loss.backward();
opt.step()`` (the output, and with it the untiled logits, held through backward). After
a warm-up step, the growth of RssAnon (/proc/self/status) during one step, its peak sampled every
millisecond by a thread (matmuls release the GIL), with glibc unmapping freed blocks
(tests/_rss.py). The tiled run goes first, so the untiled one's freed logits cannot hide in it.
"""

from __future__ import annotations

import threading
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from _rss import anon_rss, return_freed_memory_to_the_os
from _worker import finish, start

import zero_strategy as zs


def peak_growth(call) -> int:
    before = peak = anon_rss()
    running = True

    def sample():
        nonlocal peak
        while running:
            peak = max(peak, anon_rss())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        call()
    finally:
        running = False
        thread.join()
    return max(peak, anon_rss()) - before


def measure(seq: int, vocab: int, tiled) -> dict:
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model, opt = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          {"stage": 3, "param_persistence_threshold": 0, "tiled_loss": tiled})
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    losses = []

    def step():
        outputs = model(input_ids=ids, labels=ids)  # the HF idiom: the output (and its logits) held
        outputs.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(outputs.loss.item())

    step()  # warm-up: gradient buffers
    growth = peak_growth(step)
    zs.teardown(model)
    return {"growth": growth, "losses": losses}


def main() -> None:
    args, out = start()
    return_freed_memory_to_the_os()
    tiled = measure(args["seq"], args["vocab"], args["chunk"])
    untiled = measure(args["seq"], args["vocab"], False)
    finish(out, {"tiled": tiled, "untiled": untiled})


if __name__ == "__main__":
    main()
