"""``ZeroAccelerator.save_state``/``load_state`` of an expert-parallel Mixtral under ``accelerate launch``
(tests/test_expert_parallel_checkpoint.py).

A ZeroAccelerator with ``{"preset": "zero3", "expert_parallel_size": 2}`` prepares a tiny Mixtral and its
AdamW, trains 2 steps on this process's half of each batch (routing differs by process), ``save_state``,
and trains 2 more: the uninterrupted run. A second ZeroAccelerator prepares the same model built from
another seed, ``load_state`` of that directory, and trains the last 2 steps. Reported: both runs' losses of
the last 2 steps and whether their full weights are equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _worker import finish  # noqa: E402
from expert_parallel import _batch, _model  # noqa: E402

import zero_strategy as zs  # noqa: E402
from zero_strategy.accelerate import ZeroAccelerator  # noqa: E402

CONFIG = {"preset": "zero3", "expert_parallel_size": 2, "param_persistence_threshold": 0}


def _prepared(seed: int):
    acc = ZeroAccelerator(CONFIG)
    model = _model("mixtral")
    if seed != 5:
        torch.manual_seed(seed)
        for p in model.parameters():
            p.data.normal_(0, 0.05)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    return acc, model, opt


def _steps(acc, model, opt, steps) -> list[float]:
    losses = []
    for step in steps:
        _, mine = _batch(acc.process_index, step)
        loss = model(input_ids=mine, labels=mine).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(acc.reduce(loss.detach(), reduction="mean")))
    return losses


def main() -> None:
    out = Path(sys.argv[1])
    acc, model, opt = _prepared(5)
    _steps(acc, model, opt, range(2))
    acc.save_state(str(out / "state"))
    reference = _steps(acc, model, opt, range(2, 4))
    want = zs.full_state_dict(model)
    acc2, model2, opt2 = _prepared(11)
    acc2.load_state(str(out / "state"))
    resumed = _steps(acc2, model2, opt2, range(2, 4))
    got = zs.full_state_dict(model2)
    finish(out, {"reference": reference, "resumed": resumed,
                 "weights_equal": sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want),
                 "zero_dirs": sorted(p.name for p in (out / "state").iterdir())})


if __name__ == "__main__":
    main()
