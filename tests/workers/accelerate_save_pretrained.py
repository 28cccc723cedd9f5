"""``save_pretrained`` of a stage-3 model under ``accelerate launch``, the way users write it.

For a tiny LlamaForCausalLM with tied and with untied embeddings: a ZeroAccelerator
(stage 3, every parameter sharded) and torch DDP train copies of the same model on the
same data for 3 steps; then, on every process,

* ``accelerator.unwrap_model(model).save_pretrained(d, is_main_process=...,
  save_function=accelerator.save)`` (Accelerate's documented call), and
* plain ``model.save_pretrained(d)`` on all ranks.

The main process also writes the DDP model with ``save_pretrained`` (the reference
directory). The test reloads all of them in a plain process. Reported per rank: the
loss pairs and the largest difference of ``zs.full_state_dict`` from DDP's weights.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

from _worker import finish
from zero_strategy.accelerate import ZeroAccelerator

import zero_strategy as zs

VOCAB = 64


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    torch.manual_seed(3)
    return LlamaForCausalLM(cfg)


def train_and_save(acc: ZeroAccelerator, tied: bool, out: Path) -> dict:
    base = tiny_llama(tied)
    ref = copy.deepcopy(base)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = copy.deepcopy(base)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + acc.process_index)
        ids = torch.randint(0, VOCAB, (2, 12), generator=g)
        lr_ = ddp(input_ids=ids, labels=ids).loss
        lr_.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        lz = model(input_ids=ids, labels=ids).loss
        acc.backward(lz)
        opt.step()
        opt.zero_grad()
        losses.append((lz.item(), lr_.item()))

    name = "tied" if tied else "untied"
    unwrapped = acc.unwrap_model(model)
    unwrapped.save_pretrained(out / f"{name}_accelerate", is_main_process=acc.is_main_process,
                              save_function=acc.save)
    model.save_pretrained(out / f"{name}_plain")  # on every rank, no arguments
    if acc.is_main_process:
        ref.save_pretrained(out / f"{name}_ddp")
    acc.wait_for_everyone()

    full = zs.full_state_dict(model)
    ref_sd = ref.state_dict()
    return {"losses": losses, "same_object": unwrapped is model,
            "trained_vs_ddp": max((full[k] - v.float()).abs().max().item() for k, v in ref_sd.items())}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    acc = ZeroAccelerator({"stage": 3, "param_persistence_threshold": 0})
    report = {"num_processes": acc.num_processes, "stage": acc.zero_config.stage,
              "threshold": acc.zero_config.param_persistence_threshold}
    for tied in (True, False):
        report["tied" if tied else "untied"] = train_and_save(acc, tied, out)
    finish(out, report)


if __name__ == "__main__":
    main()
