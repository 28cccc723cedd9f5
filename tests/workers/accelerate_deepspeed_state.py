"""``ZeroAccelerator.load_state`` on a directory Accelerate's DeepSpeed plugin saved (its ``pytorch_model/``
tag of DeepSpeed's files, ``latest``, Accelerate's RNG states), then tests/workers/deepspeed_checkpoint.py's
steps SAVE_AT..END on the same global batches, the loop Accelerate teaches.

args: ``dir``, ``preset``. Reports the global losses; rank 0 writes the fp32 weights to ``<out>/resumed.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _models import TinyLM, loss_fn, param_groups  # noqa: E402
from _worker import finish  # noqa: E402
from deepspeed_checkpoint import END, GLOBAL, SAVE_AT, global_batch  # noqa: E402

import zero_strategy as zs  # noqa: E402
from zero_strategy.accelerate import ZeroAccelerator  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    acc = ZeroAccelerator(zero_config=args["preset"])
    torch.manual_seed(99)  # other weights than the DeepSpeed run's: the load must replace them
    model = TinyLM(layers=2)
    opt = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))
    model, opt = acc.prepare(model, opt)
    acc.load_state(args["dir"])
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(SAVE_AT, END):
        tokens, targets = global_batch(step)
        per = GLOBAL // world
        loss = loss_fn(model(tokens[rank * per:(rank + 1) * per]), targets[rank * per:(rank + 1) * per])
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    weights = zs.full_state_dict(model, dtype=None)
    if acc.is_main_process:
        torch.save({"final": {k: v for k, v in weights.items() if k != "frozen_mix"}, "frozen": weights["frozen_mix"]},
                   out / "resumed.pt")
    finish(out, {"losses": losses})


if __name__ == "__main__":
    main()
