"""The bytes autograd saves on each rank of an SP group, for tests/test_estimate_sequence_parallel.py.

Every rank sets up a tiny Llama (stage 1: its parameters are views of the flat buffers, whose
storages the count leaves out) with ``sequence_parallel_size`` of the case, shards a whole
sample with ``zs.shard_sequence`` and runs the forward and the loss as the SP loop does
(``model(**shard)``, ``model.loss_function(..., shift_labels=...)`` or, with the tiled loss, the
model's own loss, then ``zs.sequence_parallel_loss``) under ``saved_tensors_hooks``, adding the
bytes of every distinct storage a saved tensor lives in, parameters excluded: what this rank's
forward keeps for backward, measured without the formula.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from _models import saved_storages
from _worker import finish, run_cases, start

import zero_strategy as zs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def config_of(case: dict) -> LlamaConfig:
    return LlamaConfig(vocab_size=case["vocab"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=case["kv_heads"], max_position_embeddings=256,
                       tie_word_embeddings=False, attn_implementation=case["attn"])


def run(case: dict) -> dict:
    torch.manual_seed(0)
    model = LlamaForCausalLM(config_of(case)).to(DTYPES[case["precision"]]).train()
    config = {"stage": 1, "sequence_parallel_size": case["sp"], "precision": case["precision"]}
    if case.get("tiled_loss"):
        config["tiled_loss"] = case["tiled_loss"]
    model, _ = zs.setup(model, None, config)
    b, s = case["batch"], case["seq"]
    ids = torch.randint(1, case["vocab"], (b, s), generator=torch.Generator().manual_seed(b * s))
    shard = zs.shard_sequence({"input_ids": ids, "labels": ids}, model)
    with saved_storages(model) as storages:
        if case.get("tiled_loss"):
            loss = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                         shift_labels=shard["shift_labels"], use_cache=False).loss
        else:
            logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
            loss = model.loss_function(logits=logits, labels=None, shift_labels=shard["shift_labels"],
                                       vocab_size=case["vocab"])
        loss = zs.sequence_parallel_loss(loss, shard["shift_labels"], model)
    loss.backward()
    zs.teardown(model, keep_weights=False)
    return {"case": case, "saved": sum(storages.values()), "rank": dist.get_rank()}


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run)})


if __name__ == "__main__":
    main()
