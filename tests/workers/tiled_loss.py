"""The tiled loss on 2 ranks against one process on the whole data (tests/test_tiled_loss_ranks.py).

Each case: an untied tiny Llama (its head a stage-3 unit of its own, gathered around the tiled loss)
trained 3 SGD steps by ``outputs = model(**batch); outputs.loss.backward()`` with
``ZeroConfig(tiled_loss=...)``; rank r trains on batch r, and at step 1 rank 1's labels are all -100
(a shard of prompt tokens). The reference, on every rank: the same model not set up, trained on both
ranks' batches in one process by transformers' own loss, the mean over ranks of each rank's loss (a
rank without a valid label adds 0), which is what data parallelism averages.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from _worker import finish, run_cases, start

import zero_strategy as zs

VOCAB = 512


def tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(3)
    return LlamaForCausalLM(cfg)


def batch(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = ids.clone()
    labels[:, :5] = -100
    if step == 1 and rank == 1:
        labels[:] = -100
    return {"input_ids": ids, "labels": labels}


def reference_loss(model, b: dict) -> torch.Tensor:
    if (b["labels"] != -100).any():
        return model(**b).loss
    return 0.0 * model(b["input_ids"]).logits.sum()  # no valid label: adds nothing, keeps the graph


def run(case: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    base = tiny_llama()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    if case.get("checkpointing"):
        model.gradient_checkpointing_enable()
    config = {"stage": case["stage"], "param_persistence_threshold": 0, "tiled_loss": 3,
              **case.get("config", {})}
    model, opt = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.5), config)
    units = [u.name for u in zs.api._engine_of(model).units]
    losses, ref_losses = [], []
    for step in range(3):
        outputs = model(**batch(rank, step))
        outputs.loss.backward()
        opt.step()
        opt.zero_grad()
        per_rank = [reference_loss(ref, batch(r, step)) for r in range(world)]
        (sum(per_rank) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(outputs.loss.item())
        ref_losses.append(float(per_rank[rank]))
        assert outputs.logits is None
    trained = zs.full_state_dict(model)
    weight_diff = max(((trained[k] - v).abs().max() / v.abs().max().clamp(min=1e-12)).item()
                      for k, v in ref.state_dict().items())
    zs.teardown(model)
    return {"case": case["name"], "units": units, "losses": losses, "ref_losses": ref_losses,
            "weight_rel_diff": weight_diff}


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run, key="case")})


if __name__ == "__main__":
    main()
