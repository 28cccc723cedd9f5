"""PEFT LoRA trained with a ZeroAccelerator at stages 1-3 under ``accelerate launch``.

The model is prepared the way PEFT's Accelerate examples do, and saved their way:
``accelerator.unwrap_model(model).save_pretrained(d, is_main_process=...,
save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))``.
Each stage is compared with a plain PEFT model trained on the whole global batch
(tests/_peft_models.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from _peft_models import after_training, batch, lora, reference, tiny_llama
from _worker import finish
from zero_strategy.accelerate import ZeroAccelerator

STEPS = 3


def run(stage: int, out: Path) -> dict:
    acc = ZeroAccelerator({"stage": stage, "param_persistence_threshold": 0})
    model = lora(tiny_llama())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    for step in range(STEPS):
        ids = batch(step, acc.process_index)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()

    def save(m, directory):
        unwrapped = acc.unwrap_model(m)
        unwrapped.save_pretrained(directory, is_main_process=acc.is_main_process, save_function=acc.save,
                                  state_dict=acc.get_state_dict(m))
        acc.wait_for_everyone()

    ref = reference(STEPS, acc.num_processes)
    return after_training(acc.unwrap_model(model), ref, out, f"accelerate-s{stage}", acc.process_index, save)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    finish(out, {f"stage{s}": run(s, out) for s in (1, 2, 3)})


if __name__ == "__main__":
    main()
