"""torch's Muon recipe (Muon on the 2-D hidden matrices, AdamW on the rest: two optimizers) in
Accelerate's quick-tour loop, stock ``accelerate.Accelerator`` (DDP) against ZeroAccelerator.

Both optimizers go through ``accelerator.prepare`` with the model and the dataloader, then
``optimizer.zero_grad()``, ``accelerator.backward(loss)``, ``optimizer.step()`` for each. Cases,
each rank in one process: ``stock`` (DDP, the reference), ``zero1``/``zero2``/``zero3``/
``zero2_offload`` (ZeroAccelerator with that preset), and ``zero2_sgd``: the same loop with
SGD-momentum in Muon's place, which must land elsewhere (a ZeRO that skipped Muon's
orthogonalization would compute it). Each reports the flattened final weights and the
optimizer layout the engine chose.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _models import VOCAB, TinyLM, whole_tensor_recipe  # noqa: E402
from _worker import finish  # noqa: E402

import accelerate  # noqa: E402
import zero_strategy as zs  # noqa: E402
from zero_strategy.accelerate import Accelerator as ZeroAccelerator  # noqa: E402

ROWS_PER_PROCESS, STEPS = 4, 4
PRESETS = ("zero1", "zero2", "zero3", "zero2_offload")


def dataset():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (ROWS_PER_PROCESS * 2 * STEPS, 9), generator=g)


def train(accelerator, recipe: str):
    torch.manual_seed(0)
    model = TinyLM()
    muon, adamw = whole_tensor_recipe(model, recipe)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=ROWS_PER_PROCESS)
    model, muon, adamw, loader = accelerator.prepare(model, muon, adamw, loader)
    for tokens in loader:
        muon.zero_grad()
        adamw.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        accelerator.backward(loss)
        muon.step()
        adamw.step()
    if zs.is_set_up(model):
        state = zs.full_state_dict(model)
        layouts = sorted({"owned" if g.owned else "flat" for g in zs.api._engine_of(model).groups if g.trainable})
    else:
        state, layouts = accelerator.unwrap_model(model).state_dict(), []
    flat = torch.cat([v.detach().float().flatten() for _, v in sorted(state.items())]).tolist()
    return {"weights": flat, "layouts": layouts}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    report = {"stock": train(accelerate.Accelerator(), "muon")}
    for preset in PRESETS:
        report[preset] = train(ZeroAccelerator(preset), "muon")
    report["zero2_sgd"] = train(ZeroAccelerator("zero2"), "sgd_in_muons_place")
    torch.distributed.barrier()
    finish(out, report)


if __name__ == "__main__":
    main()
