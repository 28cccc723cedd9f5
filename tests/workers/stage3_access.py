"""Stage-3 access paths outside the plain training loop, checked against DDP.

1. eval / no_grad forwards at several depths (early exits: units out of the usual
   order, prefetched units that are never used) between training steps;
2. full_state_dict on every rank and rank0_only;
3. gathered_parameters: reading full parameters, and a modification on one rank
   that must reach every rank and the fp32 masters (training continues from it).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _worker import finish, start
from _models import TinyLM, batch, loss_fn, param_groups

import zero_strategy as zs


def max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def main() -> None:
    args, out = start()
    rank = dist.get_rank()
    torch.manual_seed(7)
    base = TinyLM(layers=4)
    ref = copy.deepcopy(base)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(param_groups(ref))
    model = copy.deepcopy(base)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)),
                           zs.ZeroConfig(stage=3, param_persistence_threshold=args.get("persistence", 0),
                                         prefetch=args.get("prefetch", 1)))
    report: dict = {"eval_diffs": [], "train_loss_diffs": []}

    def train_step(step):
        tokens, targets = batch(rank, step, 0)
        lr_ = loss_fn(ddp(tokens), targets)
        lr_.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        lz = loss_fn(model(tokens), targets)
        lz.backward()
        zopt.step()
        zopt.zero_grad()
        report["train_loss_diffs"].append(abs(lz.item() - lr_.item()))

    def eval_at(depth, step):
        tokens, _ = batch(rank, step, 5)
        model.eval()
        ref.eval()
        with torch.no_grad():
            diff = (model(tokens, depth=depth) - ref(tokens, depth=depth)).abs().max().item()
        model.train()
        ref.train()
        report["eval_diffs"].append(diff)

    for step in range(3):
        train_step(step)
        for depth in (1, 4, 2):
            eval_at(depth, step)
        # a forward with grad whose output is never backpropagated, then training again
        model(batch(rank, step, 6)[0], depth=2)
    # units left sharded after all of that
    engine = zs.api._engine_of(model)
    report["units_gathered_after"] = [u.name for u in engine.units[1:] if u.state.value == "gathered"]

    full = zs.full_state_dict(model)
    report["full_vs_ddp"] = max_diff(full, ref.state_dict())
    rank0 = zs.full_state_dict(model, rank0_only=True)
    report["rank0_only_keys"] = len(rank0)
    report["rank0_only_vs_full"] = max_diff(rank0, full) if rank0 else None

    # read full parameters inside the context, sharded again afterwards
    with zs.gathered_parameters(model):
        report["gathered_shape"] = list(model.layers[1].fc1.weight.shape)
        report["gathered_vs_ddp"] = (model.layers[1].fc1.weight - ref.layers[1].fc1.weight).abs().max().item()
    report["shape_after"] = list(model.layers[1].fc1.weight.shape)
    report["bytes_after"] = model.layers[1].fc1.weight.untyped_storage().nbytes()

    # modify on rank 0 only; every rank and the masters must take it
    with zs.gathered_parameters(model, params=[model.layers[2].fc2.weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.layers[2].fc2.weight.mul_(0.5)
    with torch.no_grad():
        ref.layers[2].fc2.weight.mul_(0.5)
    report["after_modify_vs_ddp"] = max_diff(zs.full_state_dict(model), ref.state_dict())
    for step in range(3, 5):
        train_step(step)
    report["final_vs_ddp"] = max_diff(zs.full_state_dict(model), ref.state_dict())
    finish(out, report)


if __name__ == "__main__":
    main()
