"""One training step with ``shard_group_size=args["k"]`` on 4 ranks, counting every collective at
the torch call (patched ``torch.distributed`` functions), apart from the engine's own counters.

Reports per stage: elements the engine moved inside the shard group (all-gather and
reduce-scatter volumes) and across groups (all-reduce of gradient shards), as counted at
the torch call, the engine's ``comm_stats``, and the parameter counts theory needs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from _worker import finish, start
from _models import TinyLM, batch, loss_fn

import zero_strategy as zs
import zero_strategy._comm.collectives as collectives


def counting(comm_of):
    """Patch the torch collectives the engine calls; count full-buffer elements per (kind, group)."""
    counts: dict[str, int] = {}

    def bump(kind, group, numel):
        comm = comm_of()
        if comm is None:
            return
        where = "inter" if group is comm.replicate_group and group is not None else "intra"
        counts[f"{where}_{kind}"] = counts.get(f"{where}_{kind}", 0) + numel

    ag, rs, ar = collectives._all_gather_single, dist.reduce_scatter, dist.all_reduce

    def all_gather(out, inp, group=None, async_op=False):
        bump("all_gather", group, out.numel())
        return ag(out, inp, group=group, async_op=async_op)

    def reduce_scatter(out, inputs, group=None, async_op=False, **kw):
        bump("reduce_scatter", group, sum(t.numel() for t in inputs))
        return rs(out, inputs, group=group, async_op=async_op, **kw)

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        bump("all_reduce", group, t.numel())
        return ar(t, op=op, group=group, async_op=async_op)

    collectives._all_gather_single, dist.reduce_scatter, dist.all_reduce = all_gather, reduce_scatter, all_reduce
    return counts


def main() -> None:
    args, out = start()
    rank, k = dist.get_rank(), args["k"]
    results = []
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = TinyLM(layers=2)
        trainable = sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        # outside the blocks (embedding, frozen_mix, final norm; the head is tied): stage 3's root
        # unit, gathered once per step (it stays gathered from forward to the end of backward)
        root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers."))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=stage, shard_group_size=k,
                                                           param_persistence_threshold=0))
        engine = zs.api._engine_of(model)
        patched = {}
        restore = (collectives._all_gather_single, dist.reduce_scatter, dist.all_reduce)
        patched = counting(lambda: engine.comm)
        tokens, targets = batch(rank, 0, 0)
        loss_fn(model(tokens), targets).backward()
        zopt.step()
        zopt.zero_grad()
        collectives._all_gather_single, dist.reduce_scatter, dist.all_reduce = restore
        results.append(dict(stage=stage, counted=patched, stats=zs.comm_stats(model), trainable=trainable,
                            frozen=frozen, root=root, shard_world=engine.comm.world_size, replicas=engine.comm.replicas))
        zs.teardown(model, keep_weights=False)
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
