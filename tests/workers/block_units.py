"""Stage 3 on models whose blocks live in nn.Sequential (tests/_block_models.py), next to torch DDP.

args["models"]: names in _block_models.MODELS. Reports per model: the units found,
per-step losses of both sides and the largest relative difference of the final state
dict (per tensor: max|a-b| / max|ref|), parameters and BatchNorm buffers alike; DDP
runs with broadcast_buffers=False so each rank's running statistics evolve locally,
as they do under zero_strategy.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _block_models import MODELS, images
from _worker import finish, run_cases, start, worst_rel_diff

import zero_strategy as zs


def run(name: str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(1234)
    base = MODELS[name]()
    ref = DDP(copy.deepcopy(base), broadcast_buffers=False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    model = copy.deepcopy(base)
    model, zopt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                           zs.ZeroConfig(stage=3, param_persistence_threshold=0))
    units = [u.name for u in zs.api._engine_of(model).units]
    losses = []
    for step in range(3):
        x, y = images(rank, step)
        loss_ref = torch.nn.functional.cross_entropy(ref(x), y)
        loss_ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        losses.append((loss.item(), loss_ref.item()))
    worst, worst_name = worst_rel_diff(zs.full_state_dict(model, dtype=None), ref.module.state_dict())
    return dict(model=name, units=units, losses=losses, weight_rel_diff=worst, worst_tensor=worst_name)


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["models"], run, key="model")})


if __name__ == "__main__":
    main()
