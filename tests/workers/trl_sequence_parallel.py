"""TRL's ``SFTTrainer`` through ``zero_trainer`` with ``SFTConfig(parallelism_config=ParallelismConfig(
sp_backend="deepspeed", sp_size=2))`` under ``accelerate launch`` (2 CPU processes), against one process
training the same tiny Llama on the whole sequences; and what it refuses.

Four pre-tokenized samples of 40 tokens (a ``labels`` column masks a 24-token prompt with -100, so the
first shard of each has no valid label), ``gradient_accumulation_steps=4`` and 2 epochs: each optimizer
step sums all four samples, so the order the sampler picks does not matter and the reference (plain
SGD, torch's ``clip_grad_norm_``) needs no sampler, as in tests/workers/hf_trainer_sequence_parallel.py.
Refusals: ``packing=True``, ``loss_type="dft"``, and a TRL trainer with a loss of its own (DPO).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch

from _compare import worst_rel_diff
from zero_strategy.transformers import zero_trainer  # before any TrainingArguments (see its module note)

import datasets  # noqa: E402
from accelerate.utils import ParallelismConfig  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

import zero_strategy as zs  # noqa: E402

VOCAB, SEQ, PROMPT = 64, 40, 24


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                      attn_implementation="sdpa")
    torch.manual_seed(5)
    return LlamaForCausalLM(cfg)


def samples() -> list[dict]:
    out = []
    for i in range(4):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(700 + i)).tolist()
        out.append({"input_ids": ids, "labels": [-100] * PROMPT + ids[PROMPT:]})
    return out


def sp_config(out: Path, **extra) -> SFTConfig:
    fields = dict(output_dir=str(out), per_device_train_batch_size=1, gradient_accumulation_steps=4,
                  num_train_epochs=2, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
                  max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
                  dataloader_num_workers=0, max_length=None, seed=3, bf16=False,
                  parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2))
    return SFTConfig(**{**fields, **extra})


def trained(out: Path) -> dict:
    model = tiny_llama()
    reference = copy.deepcopy(model)
    data = samples()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    ref_losses = []
    for _ in range(2):
        total = 0.0
        for item in data:
            loss = reference(input_ids=torch.tensor([item["input_ids"]]),
                             labels=torch.tensor([item["labels"]])).loss / len(data)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(total)
    trainer = zero_trainer(SFTTrainer)(model=model, args=sp_config(out / "sft"), processing_class=tokenizer(),
                                       train_dataset=datasets.Dataset.from_list(data), zero_config="zero3")
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    full = zs.full_state_dict(model)
    return dict(losses=losses, ref_losses=ref_losses, global_step=trainer.state.global_step,
                sp=trainer.accelerator.sequence_parallel.size,
                weight_rel_diff=worst_rel_diff(full, reference.state_dict())[0])


def refused(out: Path) -> dict:
    data = datasets.Dataset.from_list(samples())
    raised = {}
    for case, build in {
        "packing": lambda: zero_trainer(SFTTrainer)(model=tiny_llama(), args=sp_config(out / "p", packing=True, max_length=64),
                                                    processing_class=tokenizer(), train_dataset=data),
        "dft": lambda: zero_trainer(SFTTrainer)(model=tiny_llama(), args=sp_config(out / "d", loss_type="dft"),
                                                processing_class=tokenizer(), train_dataset=data),
        "dpo": lambda: zero_trainer(DPOTrainer)(
            model=tiny_llama(), ref_model=tiny_llama(), processing_class=tokenizer(),
            args=DPOConfig(output_dir=str(out / "dpo"), report_to=[], max_steps=1, per_device_train_batch_size=1, bf16=False,
                           parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)),
            train_dataset=datasets.Dataset.from_dict({"prompt": ["w1 w2 "], "chosen": ["w3"], "rejected": ["w4"]})),
    }.items():
        try:
            build()
            raised[case] = None
        except Exception as err:  # noqa: BLE001 - reported to the test
            raised[case] = f"{type(err).__name__}: {err}"
    return raised


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    report = {"trained": trained(out), "refused": refused(out)}
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(report))
    torch.distributed.barrier()
    os._exit(0)


if __name__ == "__main__":
    main()
