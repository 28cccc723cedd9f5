"""``ZeroTrainer`` with ``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed",
sp_size=2))`` under ``accelerate launch`` (2 CPU processes), against one process training the same
tiny Llama on the whole sequences.

Four samples (a prompt masked with -100), ``gradient_accumulation_steps=4`` and 2 epochs: each
optimizer step sums the gradients of all four samples, so the result does not depend on the
order the Trainer's sampler picks, and the reference (plain SGD, torch's ``clip_grad_norm_`` at
``max_grad_norm``) needs no sampler. Reports the Trainer's logged losses, the reference's, and
the worst relative difference of the final weights.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch

from _compare import worst_rel_diff
from zero_strategy.transformers import ZeroTrainer  # before TrainingArguments (see its module note)

from accelerate.utils import ParallelismConfig  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

import zero_strategy as zs  # noqa: E402

VOCAB = 64


class Samples(torch.utils.data.Dataset):
    def __init__(self, count: int = 4):
        self.items = []
        for i in range(count):
            g = torch.Generator().manual_seed(700 + i)
            ids = torch.randint(1, VOCAB, (40,), generator=g)
            labels = ids.clone()
            labels[:24] = -100  # the first shard's shifted labels: all -100
            self.items.append(dict(input_ids=ids, labels=labels))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(5)
    return LlamaForCausalLM(cfg)


def resumed(out: Path, preset: str) -> dict:
    """8 samples, 2 per step, one epoch; run A saves checkpoint-2 mid-epoch and ends; run B, a fresh
    model, resumes from checkpoint-2 (skipping the epoch's first 4 batches) and must end on A's weights."""
    data = Samples(8)

    def trainer_for(model, save: bool):
        training = TrainingArguments(
            output_dir=str(out / "resume"), per_device_train_batch_size=1, gradient_accumulation_steps=2,
            num_train_epochs=1, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
            max_grad_norm=0.5, save_strategy="steps" if save else "no", save_steps=2, logging_steps=1, report_to=[],
            disable_tqdm=True, dataloader_num_workers=0, seed=3,
            parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))
        return ZeroTrainer(model=model, args=training, train_dataset=data, zero_config=preset)

    model_a = tiny_llama()
    trainer_for(model_a, True).train()
    full_a = zs.full_state_dict(model_a)
    model_b = tiny_llama()
    trainer_b = trainer_for(model_b, False)
    trainer_b.train(resume_from_checkpoint=str(out / "resume" / "checkpoint-2"))
    return dict(resumed_rel_diff=worst_rel_diff(zs.full_state_dict(model_b), full_a)[0],
                resumed_steps=trainer_b.state.global_step)


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    if args.get("resume"):
        report = resumed(out, args["preset"])
        (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(report))
        torch.distributed.barrier()
        os._exit(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg)
    reference = copy.deepcopy(model)
    data = Samples()
    clip, lr, epochs = 0.5, 0.5, 2

    ref_opt = torch.optim.SGD(reference.parameters(), lr=lr)
    ref_losses = []
    for _ in range(epochs):
        total = 0.0
        for item in data.items:
            loss = reference(input_ids=item["input_ids"][None], labels=item["labels"][None]).loss / len(data)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(total)

    training = TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=1, gradient_accumulation_steps=4,
        num_train_epochs=epochs, learning_rate=lr, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=clip, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, per_device_eval_batch_size=1, parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))
    with torch.no_grad():  # the reference's evaluation after training: the mean of the samples' losses
        ref_eval = sum(reference(input_ids=i["input_ids"][None], labels=i["labels"][None]).loss.item()
                       for i in data.items) / len(data)
    trainer = ZeroTrainer(model=model, args=training, train_dataset=data, eval_dataset=data, zero_config=args["preset"])
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    full = zs.full_state_dict(model)
    rank = torch.distributed.get_rank()
    report = dict(losses=losses, ref_losses=ref_losses, eval_loss=eval_loss, ref_eval=ref_eval, weight_rel_diff=worst_rel_diff(full, reference.state_dict())[0],
                  global_step=trainer.state.global_step, sp=trainer.accelerator.sequence_parallel.size,
                  mesh_sp=torch.distributed.get_process_group_ranks(trainer.accelerator.torch_device_mesh["sp"].get_group()))
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
