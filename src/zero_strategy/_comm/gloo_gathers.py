"""Gathers that write straight into their output: all-gather on gloo, and gather to one rank.

[Note: gloo's all-gather holds its output twice]
gloo's all-gather (both torch forms, ``all_gather_into_tensor`` and the list form; torch 2.13)
receives into a flat buffer of its own and then copies that into the caller's output, so for
the call the process holds the output twice. On 2 CPU ranks a 256 MiB output took 256 MiB
of anonymous memory beyond it. At stage 3 on a CPU every gathered unit and every group a
``full_state_dict`` or a streamed ``save_pretrained`` gathers pays that: on the 748M Llama of
benchmarks/memory_lifecycle.py the largest group, an embedding, is 262 MB in fp32.

So on gloo an all-gather is N broadcasts, the k-th from group rank k into its own slice of
the output, issued together and waited on as one: nothing is allocated beyond the output
(measured: 0 MiB), and it was faster on the same 2 ranks (128 MiB output: 38-44 ms against
139-153 ms; 16 MiB: 6 ms against 8-13 ms; 16 KiB: 0.3-0.4 ms against 1.5 ms). NCCL
receives into the output itself and keeps its own all-gather.

A gather that only one rank keeps (``full_state_dict(rank0_only=True)``, a save that one rank
writes) needs no output on the others at all, and on the one that keeps it, no output but
the tensors it keeps. On gloo (whose own ``gather`` also copies through a buffer of the
output's size) :func:`pieces_to` sends each rank's shard, cut at the parameters' boundaries,
point to point into the slices of the host copies being built (``gather.group_values``);
the rank that keeps reads its own shard into them piece by piece. The other ranks hold their
shard, the keeping rank what it returns and a staging slot. On the 748M Llama (2 ranks,
``zero3_offload_nvme``) ``full_state_dict(rank0_only=True)`` peaked at 1.26 W on rank 0 and
0.4 W on rank 1 with all-gathers, and at 1.03 W and 0.08 W this way (W: the model's fp32
weights, above the process's baseline; the result itself is 1.0 W). NCCL uses
:func:`gather_to` (torch's ``gather``, which receives into its output).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class AllOf:
    """Several works waited on as one (the broadcasts or sends of one gather)."""

    __slots__ = ("works",)

    def __init__(self, works: list):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True


def _global(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def _own_slice(output: torch.Tensor, shard: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """This rank's slice of ``output``, holding ``shard`` (copied in unless it is already there);
    the copy keeps ``output``'s autograd version, as a collective writing into it would."""
    mine = output.view(n, -1)[rank]
    if mine.data_ptr() != shard.data_ptr():
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(output):
            mine.copy_(shard.view(-1))
    return mine


def all_gather_by_broadcasts(output: torch.Tensor, shard: torch.Tensor, group=None) -> AllOf:
    """``output[N*S] <- concat of shard[S] over the group``, async, as N broadcasts into the slices
    of ``output``. See [Note: gloo's all-gather holds its output twice]."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    _own_slice(output, shard, rank, n)
    slices = output.view(n, -1)
    return AllOf([dist.broadcast(slices[k], src=_global(group, k), group=group, async_op=True) for k in range(n)])


def gather_to(output: torch.Tensor | None, shard: torch.Tensor, dst: int, group=None) -> AllOf:
    """``output[N*S] <- concat of shard[S] over the group`` on group rank ``dst`` only (async);
    ``output`` is None on the others, which send and hold nothing more. torch's ``gather``: on
    NCCL straight into ``output``; gloo's copies through a buffer of its size, so the engine
    gives gloo :func:`pieces_to` instead."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    slices = list(output.view(n, -1)) if rank == dst else None
    return AllOf([dist.gather(shard.view(-1), slices, dst=_global(group, dst), group=group, async_op=True)])


def pieces_to(sends: list[torch.Tensor], receives: dict[int, list[torch.Tensor]] | None, dst: int,
              group=None) -> AllOf:
    """Point to point: on group rank ``dst``, ``receives[k]`` (tensors, in order) filled from what
    rank k sends; on the others, ``sends`` (in order) to ``dst``. Each rank's i-th tensor pairs
    with ``dst``'s i-th for it (tag i), so the pieces land straight in the tensors the caller
    keeps (the slices of each parameter), with no buffer of the gathered whole on any rank."""
    if dist.get_rank(group) != dst:
        to = _global(group, dst)
        return AllOf([dist.isend(t, dst=to, group=group, tag=i) for i, t in enumerate(sends)])
    return AllOf([dist.irecv(t, src=_global(group, k), group=group, tag=i)
                  for k, ts in receives.items() for i, t in enumerate(ts)])
