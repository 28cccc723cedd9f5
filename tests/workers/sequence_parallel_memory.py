"""Peak anonymous RSS of a training step at sp 1 and sp 2, same sequence, on 2 ranks.

A Llama with a 16,000-token vocabulary (the logits and the loss's copies of them are most of
the activations); one warm-up step makes the optimizer state, then the peak of ``RssAnon``
(sampled every 2 ms by a thread) above the baseline over one more step is reported, for the
same 1,024-token sample trained whole on each rank (sp 1) and split over both (sp 2).
"""

from __future__ import annotations

import gc
import threading

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from _rss import anon_rss, return_freed_memory_to_the_os
from _worker import finish, start

import zero_strategy as zs

VOCAB, SEQ = 16000, 1024


class Peak:
    def __init__(self):
        self.peak, self._stop = anon_rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, anon_rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, anon_rss())


def step(model, opt, ids, sp: int) -> None:
    """The loops users write: the output (and its logits) held until after backward."""
    if sp == 1:
        outputs = model(input_ids=ids, labels=ids)
        loss = outputs.loss
    else:
        shard = zs.shard_sequence({"input_ids": ids, "labels": ids}, model)
        outputs = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        loss = model.loss_function(logits=outputs.logits, labels=None, shift_labels=shard["shift_labels"],
                                   vocab_size=VOCAB)
        loss = zs.sequence_parallel_loss(loss, shard["shift_labels"], model)
    loss.backward()
    opt.step()
    opt.zero_grad()
    del outputs


def peak_of(sp: int) -> int:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                         attn_implementation="sdpa"))
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4),
                          {"preset": "zero3", "param_persistence_threshold": 0, "sequence_parallel_size": sp})
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    step(model, opt, ids, sp)
    gc.collect()
    dist.barrier()
    base, sampler = anon_rss(), Peak()
    step(model, opt, ids, sp)
    peak = sampler.stop() - base
    zs.teardown(model, keep_weights=False)
    return peak


def main() -> None:
    return_freed_memory_to_the_os()
    _, out = start()
    peaks = {sp: peak_of(sp) for sp in (1, 2)}
    finish(out, {"peak_sp1": peaks[1], "peak_sp2": peaks[2], "logits_bytes": SEQ * VOCAB * 4})


if __name__ == "__main__":
    main()
