"""QLoRA through TRL's documented recipe, ``zero_trainer(SFTTrainer)`` at stage 3, against the stock SFTTrainer.

Run under ``accelerate launch`` with 2 CPU processes. The recipe as TRL and PEFT teach it: the
base loaded by transformers with ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True)`` (bitsandbytes' default uint8 storage, as TRL's docs write it),
``prepare_model_for_kbit_training``, and ``SFTTrainer(peft_config=LoraConfig(...))``. Both runs
quantize the same saved bf16-free dense checkpoint (bitsandbytes' quantization is deterministic,
so both hold the same 4-bit bytes); the stock trainer runs as DDP. For a quantized base SFTTrainer
casts the adapters to bf16 (the QLoRA paper's advice); ZeRO trains them as fp32 masters computing in
its config's dtype (fp32 here), so the reference's adapters are put back to fp32 (the same bf16-rounded
values) before it trains: what is compared is the sharding, not bf16 Adam against fp32 Adam. Reported: both loss histories,
the adapters' worst relative difference, and the 4-bit bytes this rank rests on after training.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

from _compare import rel_diff
from _worker import finish
from zero_strategy.transformers import zero_trainer  # before any TrainingArguments (see its module note)

import datasets  # noqa: E402
from accelerate_trl import common, history, make_model, sft_data, tokenizer, trainable  # noqa: E402
from peft import LoraConfig, prepare_model_for_kbit_training  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

import zero_strategy as zs  # noqa: E402
from zero_strategy.api import _engine_of as engine_of  # noqa: E402


def qlora_base(dense: Path):
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.float32)  # TRL's recipe: the default uint8 storage
    model = AutoModelForCausalLM.from_pretrained(dense, quantization_config=q, device_map="cpu", dtype=torch.float32)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def packed_bytes_held(model) -> tuple[int, int]:
    """(packed bytes this rank's flat groups hold, packed bytes of the whole base)."""
    packed = {id(p): p for p in model.parameters() if type(p).__name__ == "Params4bit"}
    held = sum(t.untyped_storage().nbytes() for g in engine_of(model).groups
               if any(id(s.param) in packed for s in g.slots)
               for cat, _, t in g.held_tensors() if cat == "params")
    return held, sum(p.numel() * p.element_size() for p in packed.values())


def run(out: Path) -> dict:
    dense = out / f"dense{os.environ['RANK']}"  # each rank its own copy: no process group yet
    make_model().save_pretrained(dense)
    results = {}
    for which in ("zero", "ref"):
        cls = zero_trainer(SFTTrainer) if which == "zero" else SFTTrainer
        extra = {"zero_config": {"stage": 3, "param_persistence_threshold": 0}} if which == "zero" else {}
        model = qlora_base(dense)
        torch.manual_seed(1)  # the LoRA matrices are drawn when the trainer wraps the model
        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                 task_type="CAUSAL_LM")
        trainer = cls(model=model, args=SFTConfig(max_length=32, **common(out / which)), train_dataset=sft_data(),
                      processing_class=tokenizer(), peft_config=peft_config, **extra)
        if which == "ref":  # See the module docstring: TRL's bf16 adapters, as ZeRO holds them (fp32 masters)
            for p in trainer.model.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
        trainer.train()
        results[which] = {"wrapped": type(trainer.model_wrapped).__name__, "weights": trainable(trainer.model),
                          "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters() if p.requires_grad}),
                          **history(trainer)}
        if which == "zero":
            results[which]["packed"] = packed_bytes_held(trainer.model)
            results[which]["sharded"] = zs.is_set_up(trainer.model)
    zero, ref = results["zero"], results["ref"]
    return {"zero": {k: v for k, v in zero.items() if k != "weights"},
            "ref": {k: v for k, v in ref.items() if k != "weights"},
            "trainable": sorted(ref["weights"]), "weights_rel": rel_diff(zero["weights"], ref["weights"])}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    try:
        report = {"sft_qlora": run(out)}
    except Exception:  # noqa: BLE001 - reported to the test
        report = {"sft_qlora": {"error": traceback.format_exc()}}
        print(report["sft_qlora"]["error"], file=sys.stderr)
    finish(out, report)


if __name__ == "__main__":
    main()
