"""TRL's SFTTrainer and DPOTrainer through ``zero_trainer(cls)`` against the stock trainers (DDP).

Run under ``accelerate launch`` with 2 CPU processes. Each case trains a tiny Llama
(built from a config, a word-level tokenizer made in memory, text datasets made with
``datasets.Dataset.from_dict``) for a few optimizer steps with accumulation, clipping
and a linear schedule, twice from the same weights and data: once with the ZeRO
version of the trainer, once with the trainer itself, which Accelerate runs as DDP.
Reported per case: both loss histories (and grad norms), the worst relative
difference of the trainable weights, and for DPO what became of the reference model.

Cases (``args["cases"]``):
* ``sft``: full fine-tune, ``zero_config`` a DeepSpeed ds_config JSON (the migration
  docs/guides/migrating-from-deepspeed.md documents);
* ``sft_lora``: ``peft_config=LoraConfig(...)`` at zero3 with ``param_persistence_threshold=0``
  so the adapters are really sharded;
* ``dpo_zero3`` / ``dpo_zero2``: an explicit reference model, sharded (stage 3, with
  ``param_persistence_threshold=0`` so every parameter is) or replicated (stage 2);
* ``dpo_sync_refused``: ``sync_ref_model=True`` at stage 3 must raise at construction.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from pathlib import Path

import torch

from _compare import rel_diff
from _worker import finish
from zero_strategy.transformers import zero_trainer  # before any TrainingArguments (see its module note)

import datasets  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

import zero_strategy as zs  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(WORDS) + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg)


def sentences(g: torch.Generator, n: int, lo: int, hi: int) -> list[str]:
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=g)))
    return out


def sft_data() -> datasets.Dataset:
    return datasets.Dataset.from_dict({"text": sentences(torch.Generator().manual_seed(1), 16, 4, 12)})


def dpo_data() -> datasets.Dataset:
    g = torch.Generator().manual_seed(2)
    prompts = [p + " " for p in sentences(g, 16, 2, 6)]  # ends on a token boundary
    return datasets.Dataset.from_dict({"prompt": prompts, "chosen": sentences(g, 16, 2, 5),
                                       "rejected": sentences(g, 16, 2, 5)})


def common(out: Path) -> dict:
    return dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                learning_rate=3e-3, lr_scheduler_type="linear", max_grad_norm=0.5, logging_steps=1, save_strategy="no",
                report_to=[], seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0, bf16=False,
                fp16=False)


def trainable(model) -> dict[str, torch.Tensor]:
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    full = zs.full_state_dict(model) if zs.is_set_up(model) else model.state_dict()
    return {n: full[n].detach().float().clone() for n in names}


def history(trainer) -> dict:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    out = {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs]}
    for key in ("rewards/chosen", "rewards/margins"):
        if logs and key in logs[0]:
            out[key] = [h[key] for h in logs]
    return out


def run_sft(case: str, zero_config, out: Path) -> tuple[dict, dict]:
    peft_config = None
    if case == "sft_lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    results = {}
    for which in ("zero", "ref"):
        cls = zero_trainer(SFTTrainer) if which == "zero" else SFTTrainer
        extra = {"zero_config": zero_config} if which == "zero" else {}
        model = make_model()
        torch.manual_seed(1)  # the LoRA matrices are drawn when the trainer wraps the model
        trainer = cls(model=model, args=SFTConfig(max_length=32, **common(out / which)), train_dataset=sft_data(),
                      processing_class=tokenizer(), peft_config=peft_config, **extra)
        trainer.train()
        results[which] = {"trainer": type(trainer).__name__, "wrapped": type(trainer.model_wrapped).__name__,
                          "weights": trainable(trainer.model), **history(trainer)}
        if which == "zero":
            results[which]["stage"] = trainer.accelerator.zero_config.stage
            results[which]["sharded"] = zs.is_set_up(trainer.model)
    return results["zero"], results["ref"]


def run_dpo(case: str, zero_config, out: Path) -> tuple[dict, dict]:
    results = {}
    for which in ("zero", "ref"):
        cls = zero_trainer(DPOTrainer) if which == "zero" else DPOTrainer
        extra = {"zero_config": zero_config} if which == "zero" else {}
        model = make_model()
        ref_model = copy.deepcopy(model)
        full_ref = {k: v.clone() for k, v in ref_model.state_dict().items()}
        args = DPOConfig(beta=0.1, max_length=32, **common(out / which))
        trainer = cls(model=model, ref_model=ref_model, args=args, train_dataset=dpo_data(),
                      processing_class=tokenizer(), **extra)
        trainer.train()
        r = {"trainer": type(trainer).__name__, "wrapped": type(trainer.model_wrapped).__name__,
             "weights": trainable(trainer.model), **history(trainer)}
        if which == "zero":
            ref = trainer.ref_model
            r["stage"] = trainer.accelerator.zero_config.stage
            r["ref_is_users"] = ref is ref_model
            r["ref_sharded"] = zs.is_set_up(ref)
            r["ref_full_bytes"] = sum(t.numel() * t.element_size() for t in full_ref.values())
            if r["ref_sharded"]:
                mem = zs.memory_report(ref)
                r["ref_bytes_by_category"] = {k: int(v) for k, v in mem.by_category.items()}
            # the reference weights did not move (frozen use only)
            now = zs.full_state_dict(ref) if r["ref_sharded"] else ref.state_dict()
            r["ref_unchanged"] = all(torch.equal(now[k], v) for k, v in full_ref.items())
        results[which] = r
    return results["zero"], results["ref"]


def sync_refused(out: Path) -> dict:
    model = make_model()
    try:
        zero_trainer(DPOTrainer)(model=model, ref_model=copy.deepcopy(model), train_dataset=dpo_data(),
                                 args=DPOConfig(sync_ref_model=True, **common(out)), processing_class=tokenizer(),
                                 zero_config="zero3")
    except NotImplementedError as e:
        return {"raised": str(e)}
    return {"raised": None}


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    ds_config = out / "ds_config.json"
    ds_config.write_text(json.dumps(args["ds_config"]))
    configs = {"sft": str(ds_config), "sft_lora": {"stage": 3, "param_persistence_threshold": 0},
               "dpo_zero3": {"stage": 3, "param_persistence_threshold": 0}, "dpo_zero2": "zero2"}
    report = {}
    for case in args["cases"]:
        if case == "dpo_sync_refused":
            report[case] = sync_refused(out / case)
            continue
        try:
            run = run_sft if case.startswith("sft") else run_dpo
            zero, ref = run(case, configs[case], out / case)
            report[case] = {"zero": {k: v for k, v in zero.items() if k != "weights"},
                            "ref": {k: v for k, v in ref.items() if k != "weights"},
                            "trainable": sorted(ref["weights"]), "weights_rel": rel_diff(zero["weights"], ref["weights"])}
        except Exception:  # noqa: BLE001 - reported to the test; the ranks stop together
            report[case] = {"error": traceback.format_exc()}
            print(report[case]["error"], file=sys.stderr)
            break
    finish(out, report)


if __name__ == "__main__":
    main()
