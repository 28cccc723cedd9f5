"""DeepSpeed's ALST (Arctic Long Sequence Training) on sp_bench.py's model: the comparator rows.

The same Llama-style model, seed, length, SP degree and loss as sp_bench.py's ``one_run``, set up
as DeepSpeed's ALST tutorial does it (DeepSpeed 0.19): ``UlyssesSPAttentionHF.register_with_transformers``
wraps transformers' sdpa function and builds the SP groups (consecutive ranks, as ours),
``deepspeed.initialize(..., mpu=...)`` with ZeRO stage 3 and
``stage3_param_persistence_threshold=0`` (our ``param_persistence_threshold=0``), fp32, torch's AdamW,
no clipping; ``UlyssesSPDataLoaderAdapter`` shards each sample. The loss is the tutorial's: each
rank's shard loss from ``shift_labels``, weighted by the shard's tokens and summed over the group
with autograd; by a differentiable all-reduce rather than the tutorial's all-gather, whose backward on
gloo scatters from global rank 0 and fails in a group without it (torch 2.13:
"Global rank 0 is not part of group"); both backwards sum the group's gradients. With the tiled
loss, DeepSpeed's ``TiledFusedLogitsLoss`` over the final hidden states, in as many shards as our
tiled loss has chunks (our default chunk), so neither makes the whole logits.

The adapter gathers one sample from each rank of the group and yields them in turn; every rank of a
group reads the same samples here (as in ``one_run``), so the first step trains on the same sample as
ours and the first losses agree (printed beside each row).

Registering replaces ``ALL_ATTENTION_FUNCTIONS["sdpa"]`` in the process, so sp_bench.py runs these
rows after its own; each run puts the function back and releases DeepSpeed's SP groups.
"""

from __future__ import annotations

import gc


def deepspeed_run(args, length: int, sp: int, tiled: bool) -> dict:
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (TiledFusedLogitsLoss, UlyssesSPAttentionHF,
                                                                UlyssesSPDataLoaderAdapter)
    from sp_bench import MiB, _llama_config, estimate_bytes, measure
    from transformers import LlamaForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zero_strategy._model.tiled_loss import default_chunk_tokens

    if args.tiled_mlp or args.checkpointing:
        raise SystemExit("sp_bench --deepspeed: the ALST rows cover the tiled loss only "
                         "(drop --tiled-mlp and --checkpointing)")
    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm layer over the process group already made
    rank = dist.get_rank()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(args))
    groups = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp, micro_batch_size=1,
        seq_length=length, seq_length_is_variable=True)
    conf = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True, "sequence_parallel_size": sp,
            "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                           config=conf, mpu=groups)
    group = groups.get_sequence_parallel_group()
    g = torch.Generator().manual_seed(rank // sp)  # the ranks of an SP group read the same sample, as ours
    samples = [torch.randint(0, args.vocab, (1, length), generator=g) for _ in range(args.steps + 1)]
    loader = UlyssesSPDataLoaderAdapter(
        [{"input_ids": ids, "labels": ids, "position_ids": torch.arange(length).unsqueeze(0)} for ids in samples],
        sp_rank=groups.get_sequence_parallel_rank(), sp_group=group, sp_world_size=sp, device=torch.device("cpu"))
    shards = -(-(length // sp) // default_chunk_tokens(args.vocab, length // sp))
    module = engine.module

    def shard_loss(head_owner, hidden, shift_labels):
        return head_owner.loss_function(logits=head_owner.lm_head(hidden), labels=None, shift_labels=shift_labels,
                                        vocab_size=args.vocab)

    def step(batch):
        if tiled:
            hidden = module.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).last_hidden_state
            loss = TiledFusedLogitsLoss.apply(shard_loss, module, hidden, batch["shift_labels"], None, shards,
                                              [module.lm_head.weight], "mean")
        else:
            out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
            loss = module.loss_function(logits=out.logits, labels=None, shift_labels=batch["shift_labels"],
                                        vocab_size=args.vocab)
            del out
        good = (batch["shift_labels"] != -100).view(-1).sum().to(loss.dtype)
        total = (torch.distributed.nn.functional.all_reduce(loss * good, group=group)
                 / torch.distributed.nn.functional.all_reduce(good.detach().clone(), group=group))
        engine.backward(total)
        engine.step()
        return total.item()

    batches = [next(loader) for _ in range(args.steps + 1)]
    row = measure(step, batches, args.rss_sampler)
    engine.destroy()
    del engine, module, model, loader, batches
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    mpu._release_sequence_parallel_groups()
    gc.collect()
    return {"system": "deepspeed", "rank": rank, "length": length, "sp": sp, "tiled": tiled,
            "tokens_per_rank": length // sp, **row, "estimate_MiB": estimate_bytes(args, length, sp, tiled) / MiB,
            "deepspeed": deepspeed.__version__}
