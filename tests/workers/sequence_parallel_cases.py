"""Sequence parallelism's refusals on 2 ranks, and checkpoints across SP sizes.

``mode: "refusals"``: each case sets up a model that cannot be split (or feeds a batch that
cannot be) and reports the error's type and message, and the model's attention after the
refused setup (a refused setup leaves the model as it was).

``mode: "train"``: train ``steps`` steps of the shared data with ``sequence_parallel_size=sp``
(sp 1 on one process: whole sequences, the model's own loss), starting from
``load`` (a checkpoint directory) when given and saving to ``save`` when given; reports the
losses and, on rank 0, writes the final full weights to ``weights``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from _worker import finish, run_cases, start

import zero_strategy as zs

VOCAB = 64


def llama(**overrides) -> LlamaForCausalLM:
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    kw.update(overrides)
    torch.manual_seed(7)
    return LlamaForCausalLM(LlamaConfig(**kw))


def refused_model(case: str) -> nn.Module:
    if case == "not-a-transformers-model":
        return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB))
    if case == "sliding-window":
        return MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                sliding_window=16, attn_implementation="sdpa"))
    if case == "heads-not-divisible":
        return llama(hidden_size=24, num_attention_heads=3, num_key_value_heads=3)
    if case == "kv-heads-not-divisible":
        return llama(hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    if case == "flex-attention":
        return llama(attn_implementation="flex_attention")
    return llama()


def refusal(case: str) -> dict:
    model = refused_model(case)
    before = getattr(getattr(model, "config", None), "_attn_implementation", None)
    sp = 4 if case == "size-not-dividing-world" else 2
    try:
        model, _ = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            {"preset": "zero2", "sequence_parallel_size": sp})
        if case == "generate":
            model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2)
        if case in ("packed-sequences", "left-padding"):
            ids = torch.randint(1, VOCAB, (1, 16))
            batch = dict(input_ids=ids, labels=ids)
            if case == "packed-sequences":
                batch["position_ids"] = torch.cat([torch.arange(8), torch.arange(8)]).unsqueeze(0)
            else:
                batch["attention_mask"] = torch.cat([torch.zeros(4), torch.ones(12)]).long().unsqueeze(0)
            zs.shard_sequence(batch, model)
        return dict(case=case, type=None, message="not refused")
    except (ValueError, RuntimeError) as e:
        after = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if zs.is_set_up(model):
            zs.teardown(model, keep_weights=True)
        generated = None
        if case == "generate":  # torn down: the model's own generate() again
            generated = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape[1]
        return dict(case=case, type=type(e).__name__, message=str(e), attn_before=before, attn_after=after,
                    generated_after_teardown=generated)


def samples(step: int) -> dict:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(1, VOCAB, (1, 48), generator=g)
    labels = ids.clone()
    labels[:, :10] = -100
    return dict(input_ids=ids, labels=labels)


def train(args: dict) -> dict:
    sp = args["sp"]
    model = llama()
    model, opt = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                          {"preset": args.get("preset", "zero3"), "sequence_parallel_size": sp,
                           "param_persistence_threshold": 0})
    first = 0
    if args.get("load"):
        first = zs.load_checkpoint(args["load"], model, opt)["step"]
    losses = []
    for step in range(first, first + args["steps"]):
        batch = samples(step)
        if sp == 1:
            loss = model(**batch).loss
        else:
            shard = zs.shard_sequence(batch, model)
            out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
            loss = model.loss_function(logits=out.logits, labels=None, shift_labels=shard["shift_labels"],
                                       vocab_size=VOCAB)
            loss = zs.sequence_parallel_loss(loss, shard["shift_labels"], model)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if args.get("save"):
        zs.save_checkpoint(args["save"], model, opt, extra_state={"step": first + args["steps"]})
    full = zs.full_state_dict(model)
    if args.get("weights") and (not dist.is_initialized() or dist.get_rank() == 0):
        torch.save(full, args["weights"])
    return dict(losses=losses)


def main() -> None:
    args, out = start()
    if args["mode"] == "refusals":
        finish(out, {"results": run_cases(args["cases"], refusal)})
    finish(out, train(args))


if __name__ == "__main__":
    main()
