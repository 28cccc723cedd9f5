"""``trainer.save_model(d)`` of a LoRA model at stage 3, and the stock Trainer's save of the same weights.

args["mode"]:

* ``"zero"`` (``accelerate launch``, 2 processes): for each trainer class (``ZeroTrainer``,
  ``zero_trainer(trl.SFTTrainer)``) a LoRA on a tiny Llama (tests/_peft_models.py; every
  parameter sharded, stage 3) trains 2 steps with a tokenizer as ``processing_class``; then
  every rank calls ``trainer.save_model(d)``, measured by the engine's working set (the peak
  of "gathered" bytes during the call, ``memory_report`` after ``reset_peak``). Rank 0 writes
  the trained adapter as ``get_peft_model_state_dict(model)`` reads it (through
  ``model.state_dict()``, not through the save) for the stock run.
* ``"stock"`` (one plain process): the same LoRA with those weights loaded, saved by the stock
  class (``Trainer``, ``SFTTrainer``) with ``save_model(d)``: the reference directory.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch

from zero_strategy.transformers import ZeroTrainer, zero_trainer  # before TrainingArguments

from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments  # noqa: E402

from _peft_models import Rows, lora, tiny_llama  # noqa: E402

CLASSES = ["trainer", "sft"]
STEPS, ROWS = 2, 2


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(60)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")




def text_rows():
    import datasets

    g = torch.Generator().manual_seed(1)
    lines = [" ".join(f"w{int(i)}" for i in torch.randint(0, 60, (10,), generator=g)) for _ in range(2 * STEPS * ROWS)]
    return datasets.Dataset.from_dict({"text": lines})


def build(which: str, stock: bool, model, output_dir: Path):
    common = dict(output_dir=str(output_dir), per_device_train_batch_size=ROWS, max_steps=STEPS, save_strategy="no",
                  learning_rate=1e-2, lr_scheduler_type="constant", report_to=[], seed=0, data_seed=0,
                  disable_tqdm=True, dataloader_num_workers=0)
    zero = {} if stock else {"zero_config": {"stage": 3, "param_persistence_threshold": 0}}
    if which == "trainer":
        cls = Trainer if stock else ZeroTrainer
        return cls(model=model, args=TrainingArguments(**common), train_dataset=Rows(STEPS), processing_class=tokenizer(),
                   **zero)
    from trl import SFTConfig, SFTTrainer

    cls = SFTTrainer if stock else zero_trainer(SFTTrainer)
    return cls(model=model, args=SFTConfig(max_length=16, bf16=False, **common), train_dataset=text_rows(),
               processing_class=tokenizer(), **zero)


def block_bytes(model) -> dict:
    """fp32 bytes per block of the adapter (trainable) and of the base weights, from the plain model."""
    layers = model.base_model.model.model.layers
    return {"adapter": [sum(p.numel() * 4 for p in b.parameters() if p.requires_grad) for b in layers],
            "base": [sum(p.numel() * 4 for p in b.parameters() if not p.requires_grad) for b in layers]}


def run_zero(which: str, out: Path) -> dict:
    from peft import get_peft_model_state_dict

    import zero_strategy as zs

    model = lora(tiny_llama())
    sizes = block_bytes(model)
    trainer = build(which, False, model, out / f"zero_{which}_run")
    trainer.train()
    model = trainer.model
    gc.collect()
    zs.memory_report(model, reset_peak=True)
    before = zs.memory_report(model).working_set["gathered"]
    trainer.save_model(str(out / f"zero_{which}"))
    report = zs.memory_report(model)
    res = {"sizes": sizes, "sharded": zs.is_set_up(model), "stage": trainer.accelerator.zero_config.stage,
           "gathered": report.peak_working_set["gathered"] - before,
           "gathered_after": report.working_set["gathered"] - before}
    weights = get_peft_model_state_dict(model)  # every rank: model.state_dict() gathers unit by unit
    if trainer.is_world_process_zero():
        torch.save(weights, out / f"weights_{which}.pt")
    trainer.accelerator.wait_for_everyone()
    return res


def run_stock(which: str, out: Path) -> None:
    from peft import set_peft_model_state_dict

    model = lora(tiny_llama())
    result = set_peft_model_state_dict(model, torch.load(out / f"weights_{which}.pt", weights_only=True))
    assert not result.unexpected_keys, result.unexpected_keys
    build(which, True, model, out / f"stock_{which}_run").save_model(str(out / f"stock_{which}"))


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    mode = json.loads((out / "args.json").read_text())["mode"]
    if mode == "zero":
        from _worker import finish

        finish(out, {which: run_zero(which, out) for which in CLASSES})
    for which in CLASSES:
        run_stock(which, out)
    (out / "stock.json").write_text(json.dumps({"done": CLASSES}))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
