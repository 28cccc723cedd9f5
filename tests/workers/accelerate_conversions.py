"""``accelerator.unwrap_model(model).cpu()`` after training, stock Accelerate (DDP) vs ZeroAccelerator.

The loop Accelerate's docs write (prepared model, optimizer and loader, ``backward``,
``step``, ``zero_grad``) trains 3 steps; then, as Accelerate's own tests do, the model is
unwrapped and taken to the CPU, and its parameters (``named_parameters()``, not a state
dict) are reported. Then one more step is tried with the same optimizer: stock DDP goes on
(the model was on the CPU already); ZeroAccelerator goes on exactly where ``.cpu()``
changed nothing (stages 1-2) and refuses where it gathered the weights (stage 3).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _models import VOCAB, TinyLM  # noqa: E402
from _worker import finish, run_cases  # noqa: E402

import accelerate  # noqa: E402
from zero_strategy.accelerate import ZeroAccelerator  # noqa: E402

ROWS, STEPS = 2, 4
PRESETS = ["zero1", "zero2", "zero3", "zero3_offload"]


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(accelerator) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    loader = torch.utils.data.DataLoader(torch.randint(0, VOCAB, (ROWS * 2 * STEPS, 9), generator=g), batch_size=ROWS)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = list(loader)
    for tokens in batches[:-1]:
        accelerator.backward(loss_of(model, tokens))
        optimizer.step()
        optimizer.zero_grad()
    cpu_model = accelerator.unwrap_model(model).cpu()
    after_cpu = {n: p.detach().clone() for n, p in cpu_model.named_parameters()}
    report = {"after_cpu": {n: t.flatten().tolist() for n, t in after_cpu.items()},
              "device": str(next(cpu_model.parameters()).device)}
    try:  # one more step with what the user holds
        accelerator.backward(loss_of(model, batches[-1]))
        optimizer.step()
        optimizer.zero_grad()
        report["next_step"] = {n: p.detach().flatten().tolist() for n, p in
                               accelerator.unwrap_model(model).named_parameters()}
    except Exception as err:  # noqa: BLE001 - reported to the test
        report["next_step_error"] = f"{type(err).__name__}: {err}"
    return report


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    report = {"stock": train(accelerate.Accelerator())}

    def run(preset):
        acc = ZeroAccelerator(preset)
        result = train(acc)
        acc.free_memory()
        return {"preset": preset, **result}

    report["zero"] = run_cases(PRESETS, run, key="preset")
    finish(out, report)


if __name__ == "__main__":
    main()
