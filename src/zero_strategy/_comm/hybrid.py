"""Hybrid sharding: shard within groups of k ranks, replicate across the groups.

[Note: hybrid sharding]
``ZeroConfig(shard_group_size=k)`` (``"node"``: ``LOCAL_WORLD_SIZE``, the processes of
one node) splits the N ranks into N/k *shard groups* of consecutive ranks and k
*replicate groups* (the ranks at the same place in every shard group). Parameters,
gradients and optimizer state are sharded over the shard group exactly as the plan
says for a world of k; each shard group holds a full replica. Gradients are
reduce-scattered inside the shard group, then the shard is all-reduced across the
replicate group and divided by N: FSDP2's HSDP 2-D pattern (ZeRO++'s hpZ and MiCS
are close relatives). With k = the node size the all-gathers and reduce-scatters
stay inside the node, and only 2(R-1)/R of one shard (R = N/k) per gradient crosses
nodes. k = N is plain (flat) ZeRO; k = 1 is DDP with the optimizer step on the
whole model.

The collectives layer gets the two groups and knows nothing else: the shard group is
its ``group`` (everything it did before), and :meth:`Collectives.all_reduce_replicas`
and the second leg of :meth:`Collectives.broadcast` use the replicate group.
"""

from __future__ import annotations

import os

import torch.distributed as dist


def shard_group_size(value, world_size: int) -> int:
    """``value`` (int or "node") as a number of ranks that divides the world."""
    if value == "node":
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is None:
            raise ValueError("ZeroConfig(shard_group_size='node') needs LOCAL_WORLD_SIZE (set by torchrun, "
                             "accelerate launch and Lightning); give the number of ranks per node instead")
        value = int(local)
    if world_size % value:
        raise ValueError(f"ZeroConfig(shard_group_size={value}) must divide the number of ranks, {world_size}; "
                         "use a divisor such as the number of processes per node")
    return value


def hybrid_groups(value, process_group) -> tuple[object, object]:
    """(shard group, replicate group) of this rank for ``shard_group_size=value``.

    Every rank creates every group, in the same order, as ``dist.new_group`` requires.
    ``value=None``: no hybrid, ``(process_group, None)``.
    """
    if value is None or not (dist.is_available() and dist.is_initialized()):
        return process_group, None
    if process_group is not None:
        raise ValueError("ZeroConfig(shard_group_size=...) builds its groups from the whole world; pass "
                         "process_group=None (a subgroup with hybrid sharding is not supported)")
    world, rank = dist.get_world_size(), dist.get_rank()
    k = shard_group_size(value, world)
    if k == world:
        return None, None  # one shard group: flat ZeRO
    shard, _ = dist.new_subgroups_by_enumeration([list(range(g * k, (g + 1) * k)) for g in range(world // k)])
    replicate, _ = dist.new_subgroups_by_enumeration([list(range(i, world, k)) for i in range(k)])
    assert dist.get_rank(shard) == rank % k and dist.get_rank(replicate) == rank // k
    return shard, replicate
