"""PEFT LoRA on a tiny Llama through the plain API, each stage, against one single-process model.

Every rank also trains a plain PEFT model on the whole global batch (both ranks' data,
the batch DDP would average over), so each ZeRO result has an independent reference.
Per stage (adapters sharded: ``param_persistence_threshold=0``): the peft state dict,
``save_pretrained`` of the adapter (every rank calls, rank 0 writes), ``generate()``
with a different length per rank, ``merge_and_unload()`` then ``save_pretrained`` of
the merged model, the memory report, and ``resize_token_embeddings`` after setup
(refused). One more case resizes before setup. Paths go to the test, which reloads
the files with peft alone.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from _peft_models import VOCAB, after_training, batch, lora, tiny_llama
from _worker import finish, run_cases, start

import zero_strategy as zs

STEPS = 3


def run(case: dict, out, rank: int, world: int) -> dict:
    stage, resize = case["stage"], case.get("resize_before")
    vocab = resize or VOCAB
    base = tiny_llama()
    ref_base = copy.deepcopy(base)
    if resize:
        for m in (base, ref_base):
            torch.manual_seed(11)
            m.resize_token_embeddings(resize)
    model, ref = lora(base), lora(ref_base)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=stage, param_persistence_threshold=0))
    losses = []
    for step in range(STEPS):
        ids = batch(step, rank, vocab)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        every = torch.cat([batch(step, r, vocab) for r in range(world)])
        ref_loss = ref(input_ids=every, labels=every).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
    name = f"s{stage}" + (f"-resized{resize}" if resize else "")
    probe = torch.arange(10).view(1, 10) % vocab
    res = dict(case=case, losses=losses)
    with torch.no_grad():
        res["logits_diff"] = (model(input_ids=probe).logits - ref(input_ids=probe).logits).abs().max().item()
        res["ref_logits"] = ref(input_ids=probe).logits.tolist()
    try:
        model.resize_token_embeddings(vocab + 8)
        res["resize_after_setup"] = "no error"
    except RuntimeError as e:
        res["resize_after_setup"] = str(e)
    # state dict, save_pretrained, generate per-rank lengths, merge_and_unload + save (the merged
    # base models stay inside ``model`` and ``ref``)
    res.update(after_training(model, ref, out, name, rank,
                              lambda m, d: m.save_pretrained(d, is_main_process=rank == 0)))
    with torch.no_grad():
        res["merged_logits_diff"] = (model(input_ids=probe).logits - ref(input_ids=probe).logits).abs().max().item()
    zs.teardown(model)
    return res


def memory(precision: str, lora_on: bool) -> dict:
    """Model-state bytes after one step at stage 3 in ``precision``: LoRA or a full fine-tune."""
    model = lora(tiny_llama()) if lora_on else tiny_llama()
    trainable = [p for p in model.parameters() if p.requires_grad]
    counts = dict(trainable=sum(p.numel() for p in trainable),
                  frozen=sum(p.numel() for p in model.parameters() if not p.requires_grad))
    model, zopt = zs.setup(model, torch.optim.AdamW(trainable, lr=1e-2),
                           zs.ZeroConfig(stage=3, precision=precision, param_persistence_threshold=0))
    ids = batch(0, dist.get_rank(), VOCAB)
    model(input_ids=ids, labels=ids).loss.backward()
    zopt.step()
    zopt.zero_grad()
    report = zs.memory_report(model).by_category
    zs.teardown(model, keep_weights=False)
    return dict(counts=counts, report=report)


def main() -> None:
    args, out = start()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = run_cases(args["cases"], lambda c: run(c, out, rank, world))
    memories = {f"{p}-{'lora' if on else 'full'}": memory(p, on) for p in ("fp32", "bf16") for on in (True, False)}
    finish(out, {"results": results, "memory": memories})


if __name__ == "__main__":
    main()
