"""Two optimizers over disjoint parameters of one model (a GAN-style loop) vs DDP.

Optimizer A (AdamW) owns the blocks, optimizer B (SGD with momentum) the rest. They
step on alternating iterations, each zeroing only its own gradients, as a GAN's
generator and discriminator do. Midway the run saves a checkpoint with both
optimizers, a fresh engine loads it, and training continues; everything must match
DDP with the same two torch optimizers.
"""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _compare import rel_diff
from _worker import finish, start
from _models import TinyLM, batch, loss_fn

import zero_strategy as zs


def optimizers(model):
    blocks = [p for n, p in model.named_parameters() if n.startswith("layers.") and p.requires_grad]
    rest = [p for n, p in model.named_parameters() if not n.startswith("layers.") and p.requires_grad]
    return torch.optim.AdamW(blocks, lr=3e-3), torch.optim.SGD(rest, lr=0.05, momentum=0.9)


def main() -> None:
    args, out = start()
    rank = dist.get_rank()
    torch.manual_seed(11)
    base = TinyLM(layers=3)
    ref = copy.deepcopy(base)
    ddp = DDP(ref)
    ref_opts = optimizers(ref)
    model = copy.deepcopy(base)
    model, zopts = zs.setup(model, list(optimizers(model)), zs.ZeroConfig(stage=args["stage"],
                                                                          param_persistence_threshold=0))
    ckpt = tempfile.mkdtemp(prefix="zs_multi_") + "/ckpt" if rank == 0 else None
    obj = [ckpt]
    dist.broadcast_object_list(obj)
    ckpt = obj[0]
    losses = []
    for step in range(6):
        which = step % 2
        tokens, targets = batch(rank, step, 0)
        ref_opts[which].zero_grad()
        lr_ = loss_fn(ddp(tokens), targets)
        lr_.backward()
        ref_opts[which].step()
        zopts[which].zero_grad()
        lz = loss_fn(model(tokens), targets)
        lz.backward()
        zopts[which].step()
        losses.append((lz.item(), lr_.item()))
        if step == 2:
            zs.save_checkpoint(ckpt, model, zopts, extra_state={"step": step})
            fresh = copy.deepcopy(base)
            fresh, fresh_opts = zs.setup(fresh, list(optimizers(fresh)),
                                         zs.ZeroConfig(stage=args["stage"], param_persistence_threshold=0))
            extra = zs.load_checkpoint(ckpt, fresh, fresh_opts)
            assert extra == {"step": 2}, extra
            model, zopts = fresh, fresh_opts
    full = zs.full_state_dict(model)
    wdiff = rel_diff(full, ref.state_dict())
    finish(out, dict(losses=losses, weight_rel_diff=wdiff))


if __name__ == "__main__":
    main()
