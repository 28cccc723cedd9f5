"""Accelerate's own ALST/Ulysses test loop (accelerate/test_utils/scripts/external_deps/
test_ds_alst_ulysses_sp.py) on a ZeroAccelerator, against one process on the whole sequences.

The loop is Accelerate's, line for line, with its two DeepSpeed-only lines replaced by the
generic ones: ``move_to_device(batch, model.device)`` by ``.to(device)``, and
``deepspeed.utils.groups._get_sequence_parallel_group()`` by
``accelerator.torch_device_mesh["sp"].get_group()``. Its model is a tiny Llama built here
(the hub is not reachable) and its optimizer SGD with momentum (a wrong gradient scale shows;
Adam's lr 1e-5 would hide it). args.json: ``preset``, ``attn``, ``masked_prompt`` (label the
first tokens -100 so that the first shard has none to learn from), ``from_launch_config``
(the ParallelismConfig comes from the launch's PARALLELISM_CONFIG_* variables, not the
constructor), ``refuse`` (a case that must raise: report its message).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _compare import worst_rel_diff  # noqa: E402
from _worker import finish  # noqa: E402

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import zero_strategy as zs  # noqa: E402
from zero_strategy.accelerate import ZeroAccelerator  # noqa: E402
from accelerate.utils import ParallelismConfig, set_seed  # noqa: E402
from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    attn = args.get("attn", "sdpa")
    set_seed(42)
    world_size = 2
    micro_batch_size = 1
    if args.get("from_launch_config"):
        parallelism_config = None
    else:
        parallelism_config = ParallelismConfig(
            sp_backend="deepspeed",
            sp_size=world_size,
            dp_shard_size=args.get("dp_shard_size", 1),
            sp_handler=DeepSpeedSequenceParallelConfig(
                sp_seq_length=256,
                sp_seq_length_is_variable=True,
                sp_attn_implementation=args.get("sp_attn", None if attn == "eager" else attn),
            ),
        )
    try:
        accelerator = ZeroAccelerator(args["preset"], parallelism_config=parallelism_config)
    except ValueError as e:
        if not args.get("refuse"):
            raise
        (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps({"refused": str(e)}))
        torch.distributed.barrier()
        os._exit(0)
    parallelism_config = accelerator.parallelism_config  # the launch config's, when it came from there

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, attn_implementation=attn)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    reference = copy.deepcopy(model)

    samples = 4
    seqlen = 32
    input_ids = torch.arange(1, seqlen * samples + 1).view(-1, seqlen) + 100
    position_ids = torch.arange(seqlen * samples).view(-1, seqlen)
    masked = args.get("masked_prompt", 0)

    ds = torch.utils.data.TensorDataset(input_ids, position_ids)

    def collate_fn(batch):
        input_ids, position_ids = batch[0]
        labels = input_ids.unsqueeze(0).clone()
        labels[:, :masked] = -100
        return dict(
            input_ids=input_ids.unsqueeze(0),
            position_ids=position_ids.unsqueeze(0),
            labels=labels,
        )

    dl = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    # the reference: one process, whole sequences, the model's own loss
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    ref_losses = []
    for batch in dl:
        ref_opt.zero_grad()
        loss = reference(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    rank = torch.distributed.get_rank()
    report = {"ref_losses": ref_losses}
    try:
        model, optimizer, dl = accelerator.prepare(model, optimizer, dl)
    except ValueError as e:
        if not args.get("refuse"):
            raise
        report["refused"] = str(e)
        finish(out, report)

    report["dl_len"] = len(dl)
    report["adapter_is_identity"] = accelerator.deepspeed_ulysses_dl_adapter(dl, model) is dl
    sp_size = parallelism_config.sp_size if parallelism_config else 1
    if sp_size > 1:
        sp_group = accelerator.torch_device_mesh["sp"].get_group()
        sp_world_size = parallelism_config.sp_size

    unwrapped_model = accelerator.unwrap_model(model)

    losses, seqlens = [], []
    # Normal training loop
    for iter, batch in enumerate(dl):
        optimizer.zero_grad()

        seqlens.append(len(batch["input_ids"][0]))
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        outputs = model(**batch)

        shift_labels = batch["shift_labels"]
        loss = unwrapped_model.loss_function(
            logits=outputs.logits,
            labels=None,
            shift_labels=shift_labels,
            vocab_size=unwrapped_model.config.vocab_size,
        )

        if sp_size > 1:
            # differentiable weighted per-shard-loss aggregation across ranks
            losses_per_rank = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
            # special dealing with SFT that has prompt tokens that aren't used in loss computation
            good_tokens = (shift_labels != -100).view(-1).sum()
            good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
            total_loss = sum(
                losses_per_rank[rank] * good_tokens_per_rank[rank]
                for rank in range(sp_world_size)
                if good_tokens_per_rank[rank] > 0
            )
            total_good_tokens = sum(good_tokens_per_rank)
            loss = total_loss / max(total_good_tokens, 1)

        losses.append(loss.item())
        accelerator.backward(loss)
        optimizer.step()

    # a resumed epoch (accelerator.skip_first_batches, as the Trainer resumes): still this rank's shards
    skipped = list(accelerator.skip_first_batches(dl, 2))
    report["skipped_first_tokens"] = [int(b["input_ids"][0, 0]) for b in skipped]
    report["expected_first_tokens"] = [int(input_ids[i, 16 * rank]) for i in (2, 3)]
    full = zs.full_state_dict(model)
    report.update(losses=losses, seqlens=seqlens, weight_rel_diff=worst_rel_diff(full, reference.state_dict()),
                  sp_group_ranks=torch.distributed.get_process_group_ranks(sp_group) if sp_size > 1 else None,
                  engine_sp=zs.api._engine_of(model).sequence_parallel.size, rank=rank)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    accelerator.end_training()  # the loop's last line (it also ends the process group)
    os._exit(0)


if __name__ == "__main__":
    main()
