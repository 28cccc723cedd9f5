"""``accelerator.clip_grad_value_`` in the loop Accelerate's docs write, stock Accelerate (DDP) vs ZeroAccelerator.

The loop (``accumulate``, ``backward``, ``clip_grad_value_`` when ``sync_gradients``,
``step``, ``zero_grad``) runs once per case in the same process: ``stock`` with
``accelerate.Accelerator`` (DDP, the oracle), ``stock_unclipped`` (the same without the
clip call, to show that clipping changes the result), and one ZeroAccelerator run per
preset. Each reports its flattened final weights; ``stock`` also reports the largest
gradient element it clipped, so the test can check that the clip bites.
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
import zero_strategy as zs  # noqa: E402
from zero_strategy.accelerate import ZeroAccelerator  # noqa: E402

CLIP, GAS, ROWS_PER_PROCESS, MICRO_BATCHES = 0.02, 2, 2, 6
PRESETS = ["zero1", "zero2", "zero3", "zero2_offload"]


def dataset():
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (ROWS_PER_PROCESS * 2 * MICRO_BATCHES, 9), generator=g)


def train(accelerator, clip: bool) -> tuple[list[float], float]:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=ROWS_PER_PROCESS)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    largest = 0.0
    for tokens in loader:
        with accelerator.accumulate(model):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            accelerator.backward(loss)
            if accelerator.sync_gradients and clip:
                if not getattr(accelerator, "is_zero_model", lambda m: False)(model):
                    largest = max(largest, max(float(p.grad.abs().max()) for p in model.parameters()
                                               if p.grad is not None))
                accelerator.clip_grad_value_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
    if getattr(accelerator, "is_zero_model", lambda m: False)(model):
        state = zs.full_state_dict(model)
    else:
        state = accelerator.unwrap_model(model).state_dict()
    return torch.cat([v.detach().float().flatten() for _, v in sorted(state.items())]).tolist(), largest


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    stock = accelerate.Accelerator(gradient_accumulation_steps=GAS)
    report: dict = {}
    report["stock"], report["stock_largest_grad"] = train(stock, clip=True)
    report["stock_unclipped"], _ = train(stock, clip=False)

    def run(preset):
        acc = ZeroAccelerator(preset, gradient_accumulation_steps=GAS)
        weights, _ = train(acc, clip=True)
        acc.free_memory()
        return {"preset": preset, "weights": weights}

    report["zero"] = run_cases(PRESETS, run, key="preset")
    report["clip"] = CLIP
    finish(out, report)


if __name__ == "__main__":
    main()
