"""What a stage-3 rank holds while the whole model is wanted: ``full_state_dict``,
``model.state_dict()`` and ``save_pretrained``, against a DDP-trained reference.

args["cases"]: list of {"name", "offload" (None | "cpu"), "layers"}. Per case a tiny
LlamaForCausalLM (tied embeddings) trains 2 steps under DDP and under zero_strategy
(stage 3, every parameter sharded) on the same data; then on every rank, for each call:

* the engine's working set: the peak of "gathered" bytes during the call above what was
  gathered before it (``memory_report`` after ``memory_report(reset_peak=True)``);
* the process's own peak resident memory during the call above its RSS before it
  (``VmHWM`` after ``clear_refs``, with glibc returning freed blocks: tests/_rss.py), an
  independent measure the engine cannot misreport;
* the result: devices, the largest relative difference from the DDP model's state dict.

The sizes the bounds are computed from come from the plain reference model, not from the
engine: each block's parameter bytes and the root's (everything outside the blocks, tied
weights once). The DDP model is saved with ``save_pretrained`` by rank 0 as the reference.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

from _compare import tensor_rel_diff
from _rss import measured, return_freed_memory_to_the_os
from _worker import finish, run_cases, start

import zero_strategy as zs

VOCAB = 256


def tiny_llama(layers: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    torch.manual_seed(5)
    return LlamaForCausalLM(cfg)


def unit_bytes(ref: LlamaForCausalLM) -> dict:
    """fp32 bytes of each block and of the root (what is not in a block), from the plain model."""
    blocks = [sum(p.numel() * 4 for p in layer.parameters()) for layer in ref.model.layers]
    in_blocks = {id(p) for layer in ref.model.layers for p in layer.parameters()}
    root = sum(p.numel() * 4 for p in ref.parameters() if id(p) not in in_blocks)  # parameters(): tied once
    return {"blocks": blocks, "root": root, "model": root + sum(blocks)}




def compare(got: dict, want: dict) -> dict:
    """Worst relative difference over ``want``'s keys, missing keys and the devices of ``got``."""
    missing = [k for k in want if k not in got]
    worst = max((tensor_rel_diff(got[k], v) for k, v in want.items() if k in got), default=float("inf"))
    return {"rel": worst, "missing": missing, "devices": sorted({str(t.device) for t in got.values()})}


def run(case: dict, out: Path) -> dict:
    rank = dist.get_rank()
    base = tiny_llama(case["layers"])
    ref = copy.deepcopy(base)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model = copy.deepcopy(base)
    del base
    offload = case["offload"]
    model, zopt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                           zs.ZeroConfig(stage=3, param_persistence_threshold=0,
                                         offload_optimizer=offload, offload_params=offload))
    for step in range(2):
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(input_ids=ids, labels=ids).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        zopt.step()
        zopt.zero_grad()
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    res: dict = {"case": case["name"], "rank": rank, "sizes": unit_bytes(ref)}

    full, res["full"] = measured(model, lambda: zs.full_state_dict(model))
    res["full"].update(compare(full, want))
    del full
    only, res["rank0_only"] = measured(model, lambda: zs.full_state_dict(model, rank0_only=True))
    res["rank0_only"]["entries"] = len(only)
    if only:
        res["rank0_only"].update(compare(only, want))
    del only
    sd, res["state_dict"] = measured(model, lambda: model.state_dict())
    res["state_dict"].update(compare(sd, want))
    del sd
    target = out / case["name"]
    # once unmeasured: the first save imports parts of transformers (~20 MB resident), once per process
    model.save_pretrained(out / f"{case['name']}_warm", is_main_process=rank == 0, max_shard_size=case["shard"])
    _, res["save"] = measured(model, lambda: model.save_pretrained(target, is_main_process=rank == 0,
                                                                     max_shard_size=case["shard"]))
    if rank == 0:
        ref.save_pretrained(out / f"{case['name']}_ddp")
    dist.barrier()
    zs.teardown(model, keep_weights=False)
    return res


def run_peft(case: dict, out: Path) -> dict:
    """A LoRA on a tiny Llama (tests/_peft_models.py), 2 steps at stage 3, then the adapter save:
    the gathered peak, and the saved file against a plain PEFT model trained on the global batch."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from _peft_models import batch, lora, reference, tiny_llama

    rank, world = dist.get_rank(), dist.get_world_size()
    model = lora(tiny_llama())
    trainable = [p for p in model.parameters() if p.requires_grad]
    sizes = {"adapter_per_block": [sum(p.numel() * 4 for p in layer.parameters() if p.requires_grad)
                                   for layer in model.base_model.model.model.layers],
             "base_per_block": [sum(p.numel() * 4 for p in layer.parameters() if not p.requires_grad)
                                for layer in model.base_model.model.model.layers]}
    model, zopt = zs.setup(model, torch.optim.AdamW(trainable, lr=1e-2),
                           zs.ZeroConfig(stage=3, param_persistence_threshold=0))
    for step in range(2):
        ids = batch(step, rank)
        model(input_ids=ids, labels=ids).loss.backward()
        zopt.step()
        zopt.zero_grad()
    target = out / case["name"]
    _, res = measured(model, lambda: model.save_pretrained(target, is_main_process=rank == 0))
    dist.barrier()
    if rank == 0:
        got, want = load_file(str(target / "adapter_model.safetensors")), get_peft_model_state_dict(reference(2, world))
        res.update(keys_equal=sorted(got) == sorted(want),
                   rel=max(tensor_rel_diff(got[k], v) for k, v in want.items()))
    zs.teardown(model, keep_weights=False)
    return {"case": case["name"], "rank": rank, "sizes": sizes, "save": res}


def main() -> None:
    args, out = start()
    return_freed_memory_to_the_os()
    results = run_cases(args["cases"], lambda case: (run_peft if case.get("peft") else run)(case, out))
    finish(out, {"results": results, "pid": os.getpid()})


if __name__ == "__main__":
    main()
