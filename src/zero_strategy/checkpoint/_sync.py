"""Small object collectives for checkpointing (a world of one skips them).

Checkpoint code must never leave one rank waiting in a collective while another
raised: every phase that can fail locally ends in :func:`agree`, which turns any
rank's error into the same ``CheckpointError`` on every rank.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ._layout import CheckpointError


def broadcast_object(comm, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if comm.world_size == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(comm.group, 0) if comm.group is not None else 0
    dist.broadcast_object_list(box, src=src, group=comm.group)
    return box[0]


def all_gather_object(comm, obj: Any) -> list:
    if comm.world_size == 1:
        return [obj]
    out: list = [None] * comm.world_size
    dist.all_gather_object(out, obj, group=comm.group)
    return out


def agree(comm, error: str | None) -> None:
    """Raise the same CheckpointError on every rank if any rank reports an error."""
    errors = [(r, e) for r, e in enumerate(all_gather_object(comm, error)) if e]
    if errors:
        if len(errors) == 1 or len({e for _, e in errors}) == 1:
            raise CheckpointError(errors[0][1])
        raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in errors))


def describe(err: BaseException) -> str:
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
