"""Peak anonymous RSS of one training step with checkpointing and activation offload, and without
checkpointing (tests/test_activation_offload_memory.py).

A Llama of ``layers`` layers (hidden 256, vocabulary 512: the layers, not the logits, hold most of the
activations) at stage 3 with the tiled loss, one sequence of ``seq`` tokens, trained by the HF idiom
``model(input_ids=ids, labels=ids).loss.backward(); opt.step()``. After a warm-up step, the growth of
RssAnon during one step, its peak sampled every millisecond (tests/workers/tiled_loss_memory.py's
``peak_growth``), glibc unmapping freed blocks (tests/_rss.py). The offloaded run goes first, so
the plain one's freed activations cannot hide in it.
"""

from __future__ import annotations

import torch
from tiled_loss_memory import peak_growth
from transformers import LlamaConfig, LlamaForCausalLM

from _rss import return_freed_memory_to_the_os
from _worker import finish, start

import zero_strategy as zs
from zero_strategy._model.activation_offload import offload_counts


def llama_config(seq: int, layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                       tie_word_embeddings=False)


def measure(seq: int, layers: int, offload: bool) -> dict:
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(seq, layers))
    if offload:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, opt = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          {"stage": 3, "param_persistence_threshold": 0, "tiled_loss": True,
                           "activation_offload": offload})
    ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(1))
    losses = []

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    step()  # warm-up: gradient buffers
    sent = offload_counts(model).bytes if offload else 0
    growth = peak_growth(step)
    sent = (offload_counts(model).bytes - sent) if offload else 0
    zs.teardown(model)
    return {"growth": growth, "losses": losses, "sent_to_host": sent}


def main() -> None:
    args, out = start()
    return_freed_memory_to_the_os()
    offloaded = measure(args["seq"], args["layers"], True)
    plain = measure(args["seq"], args["layers"], False)
    finish(out, {"offloaded": offloaded, "plain": plain})


if __name__ == "__main__":
    main()
