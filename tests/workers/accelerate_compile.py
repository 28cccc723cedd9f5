"""ZeroAccelerator under ``accelerate launch [--dynamo_backend aot_eager]``: the ordinary
Accelerate loop; with ``args["reference"]`` also a plain Accelerate DDP run of the same
model (only in the eager launch: a dynamo backend applies to every Accelerator of the
process). Each rank reports per-step losses and the final full weights' fingerprint;
rank 0 saves the weights to ``<out>/<name>.pt`` for the test to compare.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _models import SEQ, VOCAB, TinyLM, loss_fn, param_groups  # noqa: E402
from _worker import finish  # noqa: E402

import zero_strategy as zs  # noqa: E402
from zero_strategy.accelerate import ZeroAccelerator  # noqa: E402

ZERO = {"preset": "zero3", "param_persistence_threshold": 0}
STEPS, ROWS = 3, 4  # rows per process and step


def _data(rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=g), torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def _train(acc, model) -> list[float]:
    opt = torch.optim.AdamW(param_groups(model))
    model, opt = acc.prepare(model, opt)
    losses = []
    for step in range(STEPS):
        tokens, targets = _data(acc.process_index, step)
        loss = loss_fn(model(tokens), targets)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    acc = ZeroAccelerator(ZERO)
    model = copy.deepcopy(base)
    report = {"dynamo_backend": str(acc.state.dynamo_plugin.backend), "losses": _train(acc, model)}
    weights = {k.replace("_orig_mod.", ""): v for k, v in zs.full_state_dict(model).items()}
    report["compiled_calls"] = model._compiled_call_impl is not None or any(
        m._compiled_call_impl is not None for m in model.modules())
    if args.get("reference"):
        from accelerate import Accelerator

        ref = copy.deepcopy(base)
        report["losses_ddp"] = _train(Accelerator(), ref)
        if acc.is_main_process:
            torch.save({k: v.detach().clone() for k, v in ref.state_dict().items()}, out / "ddp.pt")
    if acc.is_main_process:
        torch.save(weights, out / f"{args['name']}.pt")
    finish(out, report)


if __name__ == "__main__":
    main()
