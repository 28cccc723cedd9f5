"""Two training steps on 4 ranks laid out as 2 "nodes" x 2 processes, under a real launcher.

``argv``: OUT MODE where MODE is "plain" (zero_strategy.setup), "lightning"
(``Trainer(num_nodes=2, devices=2)``) or "accelerate" (ZeroAccelerator). ``args.json``:
``stage``, ``ckpt`` (a checkpoint path per node: {"0": path, "1": path}, optional),
``shard_group_size`` (hybrid sharding through each front end's own knob, optional).

The reference is computed on every rank, in one process: the same model trained with
plain torch AdamW on each step's whole global batch (the mean of the ranks' equal-sized
micro-batches, as DDP computes). Each rank reports its launcher-given place (rank, local
rank, node), the largest relative difference of the trained weights from the reference,
and what saving a checkpoint said.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zero_strategy as zs
from _compare import rel_diff  # tests/ is on PYTHONPATH (tests/_procs.py)

STEPS, PER_RANK, LR = 2, 4, 1e-2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(2)),
                         nn.Linear(8, 1))


def data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = STEPS * PER_RANK * world
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def reference(world: int, lightning_order: bool = False) -> dict[str, torch.Tensor]:
    """``lightning_order``: the Trainer always gives a training DataLoader a shuffling
    DistributedSampler (seed 0, epoch 0), so each step's global batch is the next slice
    of that permutation."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = data(world)
    if lightning_order:
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[perm], y[perm]
    for step in range(STEPS):
        sl = slice(step * PER_RANK * world, (step + 1) * PER_RANK * world)
        nn.functional.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def worst(full: dict, ref: dict) -> float:
    return rel_diff(full, ref)


def train_plain(args: dict) -> tuple[dict, object]:
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    config = zs.ZeroConfig(stage=args["stage"], shard_group_size=args.get("shard_group_size"))
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=LR), config)
    x, y = data(world)
    for step in range(STEPS):
        lo = (step * world + rank) * PER_RANK
        nn.functional.mse_loss(model(x[lo:lo + PER_RANK]), y[lo:lo + PER_RANK]).backward()
        opt.step()
        opt.zero_grad()
    return zs.full_state_dict(model), (model, opt)


def train_lightning(args: dict) -> tuple[dict, object]:
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, batch_idx):
            self.replicas = zs.api._engine_of(self).comm.replicas
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    world = int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])
    lit = Lit()
    strategy = f"zero{args['stage']}"
    if args.get("shard_group_size"):
        from zero_strategy.lightning import ZeroStrategy
        strategy = ZeroStrategy(stage=args["stage"], shard_group_size=args["shard_group_size"])
    trainer = pl.Trainer(accelerator="cpu", num_nodes=2, devices=2, strategy=strategy, max_steps=STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=True)
    trainer.fit(lit, DataLoader(TensorDataset(*data(world)), batch_size=PER_RANK))
    env = type(trainer.strategy.cluster_environment).__name__
    return {k: v.detach().clone() for k, v in lit.net.state_dict().items()}, (env, lit.replicas)


def train_accelerate(args: dict) -> tuple[dict, object]:
    from zero_strategy.accelerate import ZeroAccelerator
    acc = ZeroAccelerator(zero_config={"stage": args["stage"], "shard_group_size": args.get("shard_group_size")})
    world = acc.num_processes
    model = make_model()
    model, opt, loader = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                     DataLoader(TensorDataset(*data(world)), batch_size=PER_RANK))
    for xb, yb in loader:
        acc.backward(nn.functional.mse_loss(model(xb), yb))
        opt.step()
        opt.zero_grad()
    return zs.full_state_dict(model), (model, opt)


def save(args: dict, trained) -> str:
    """Save to this node's checkpoint path; the error text, or "" when it saved."""
    if not args.get("ckpt") or isinstance(trained[0], str):
        return "not tried"
    node = os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))
    try:
        zs.save_checkpoint(args["ckpt"][node], *trained)
        return ""
    except zs.CheckpointError as e:
        return str(e)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    place = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                            "NODE_RANK", "SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID")}
    report = dict(place=place)
    try:
        full, extra = {"plain": train_plain, "lightning": train_lightning, "accelerate": train_accelerate}[mode](args)
        world = int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])
        report["diff"] = worst(full, reference(world, lightning_order=mode == "lightning"))
        report["save"] = save(args, extra)
        report["environment"] = extra[0] if mode == "lightning" else ""
        import torch.distributed as dist
        report["global_rank"] = dist.get_rank()
        report["replicas"] = extra[1] if mode == "lightning" else zs.api._engine_of(extra[0]).comm.replicas
    except Exception:  # noqa: BLE001 - reported to the test
        report["error"] = traceback.format_exc()
    rank = report.get("global_rank", place["RANK"] or place["SLURM_PROCID"])
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
