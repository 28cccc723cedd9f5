"""A model created on the meta device, materialized unit by unit by setup, then trained vs DDP.

Each rank seeds differently before setup, so only setup's broadcast makes the ranks
agree; the DDP reference starts from the weights setup produced.
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _worker import finish, start
from _models import TinyLM, batch, loss_fn, param_groups

import zero_strategy as zs


def init(module):
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    for name, p in module.named_parameters(recurse=False):
        if name == "gate":
            p.data.fill_(0.5)
        elif name == "frozen_mix":
            p.data.normal_(0, 0.1)


def main() -> None:
    args, out = start()
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # ranks disagree until setup broadcasts
    with torch.device("meta"):
        model = TinyLM(layers=3)
    opt = torch.optim.AdamW(param_groups(model))
    model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=args["stage"], param_persistence_threshold=0),
                           param_init_fn=init)
    report = {}
    # what each rank holds locally (stages 1-2: whole parameters) must be rank 0's
    local = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    # (stage 3: released parameters are NaN placeholders, equal on every rank)
    report["ranks_agree"] = all(torch.allclose(gathered[0], g, rtol=0, atol=0, equal_nan=True) for g in gathered)
    start_sd = zs.full_state_dict(model)
    report["tied"] = model.head.weight is model.embed.weight
    report["initialized"] = bool(all(torch.isfinite(t).all() for t in start_sd.values()))
    ref = TinyLM(layers=3)
    ref.load_state_dict(start_sd)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(param_groups(ref))
    losses = []
    for step in range(3):
        tokens, targets = batch(rank, step, 0)
        lr_ = loss_fn(ddp(tokens), targets)
        lr_.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        lz = loss_fn(model(tokens), targets)
        lz.backward()
        zopt.step()
        zopt.zero_grad()
        losses.append((lz.item(), lr_.item()))
    full = zs.full_state_dict(model)
    report["losses"] = losses
    report["weight_diff"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    report["model_state_bytes"] = zs.memory_report(model).total
    finish(out, report)


if __name__ == "__main__":
    main()
