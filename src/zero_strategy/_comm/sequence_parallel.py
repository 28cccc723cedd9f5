"""Sequence parallelism's communication: its groups, its all-to-alls and its loss sum.

An SP group is ``sequence_parallel_size`` consecutive ranks that share one sample
(See [Note: sequence parallelism] in _model/sequence_parallel.py for the whole
design). Everything here is a differentiable collective over that group:

* :class:`SequenceToHeads`: ``[batch, heads, seq/N, dim]`` (this rank's slice of the
  sequence, every head) -> ``[batch, heads/N, seq, dim]`` (the whole sequence, this
  rank's heads). Its backward is the reverse all-to-all, :class:`HeadsToSequence`,
  and the other way round: each is the other's transpose.
* :class:`SumOverGroup`: every rank gets the sum of the group's values; the backward
  sums the group's gradients, as the all-gather the Hugging Face loops use does, so
  each rank of the group back-propagates the whole sample's loss.

``dist.all_to_all_single`` moves equal chunks on NCCL and on gloo, so both
directions lay the chunk index first and let the collective split dimension 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["SequenceParallelGroup", "sequence_parallel_group", "sequence_parallel_groups", "SequenceToHeads",
           "HeadsToSequence", "SumOverGroup", "sum_over_group", "gather_sequence"]


class SequenceParallelGroup:
    """This rank's SP group: the process group, the rank in it and its size (1: no SP)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def __repr__(self) -> str:
        return f"SequenceParallelGroup(rank={self.rank}, size={self.size})"


def sequence_parallel_group(size: int, process_group=None) -> SequenceParallelGroup:
    """The SP group of this rank for ``sequence_parallel_size=size``: ranks ``[g*size, (g+1)*size)``.

    ``size`` must divide the world (the quotient is the data-parallel degree)."""
    if size == 1:
        return SequenceParallelGroup(None, 0, 1)
    if process_group is not None:
        raise ValueError("ZeroConfig(sequence_parallel_size=...) builds its groups from the whole world; pass "
                         "process_group=None (sequence parallelism inside a subgroup is not supported)")
    return sequence_parallel_groups(size)[0]


#: (default group, size) -> (SP group, data-parallel group): made once per world, so a front end's
#: device mesh and the model's attention use the same process groups
_GROUPS: dict[tuple[int, int], tuple[SequenceParallelGroup, dist.ProcessGroup]] = {}


def sequence_parallel_groups(size: int) -> tuple[SequenceParallelGroup, dist.ProcessGroup]:
    """(this rank's SP group, its data-parallel group: the ranks at its place in every SP group).

    Every rank creates every group, in the same order, as ``dist.new_group`` requires."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"sequence parallelism of size {size} needs torch.distributed initialized with a multiple "
                         f"of {size} processes (torchrun --nproc-per-node {size}, accelerate launch, ...); in a "
                         "single process use a size of 1")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"sequence parallelism of size {size} must divide the number of processes, {world}; use a "
                         f"divisor of {world} (the processes left over are data parallel)")
    key = (id(dist.distributed_c10d._get_default_group()), size)
    if key not in _GROUPS:
        sp, _ = dist.new_subgroups_by_enumeration([list(range(g * size, (g + 1) * size)) for g in range(world // size)])
        dp, _ = dist.new_subgroups_by_enumeration([list(range(i, world, size)) for i in range(size)])
        _GROUPS[key] = (SequenceParallelGroup(sp, rank % size, size), dp)
    return _GROUPS[key]


def _all_to_all(chunks: torch.Tensor, group) -> torch.Tensor:
    """``chunks`` [N, ...]: chunk i goes to rank i; returns [N, ...] where chunk j came from rank j."""
    chunks = chunks.contiguous()
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    return out


def _to_heads(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """[b, h, s/N, d] -> [b, h/N, s, d]."""
    b, h, s_local, d = x.shape
    n = sp.size
    chunks = x.reshape(b, n, h // n, s_local, d).transpose(0, 1)      # [N(head chunk), b, h/N, s/N, d]
    got = _all_to_all(chunks, sp.group)                                 # [N(seq chunk), b, h/N, s/N, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s_local, d)


def _to_sequence(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """[b, h/N, s, d] -> [b, h, s/N, d]."""
    b, h_local, s, d = x.shape
    n = sp.size
    chunks = x.reshape(b, h_local, n, s // n, d).permute(2, 0, 1, 3, 4)  # [N(seq chunk), b, h/N, s/N, d]
    got = _all_to_all(chunks, sp.group)                                 # [N(head chunk), b, h/N, s/N, d]
    return got.transpose(0, 1).reshape(b, n * h_local, s // n, d)


class SequenceToHeads(torch.autograd.Function):
    """Sequence shards to head shards; See the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
        ctx.sp = sp
        return _to_heads(x, sp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _to_sequence(grad, ctx.sp), None


class HeadsToSequence(torch.autograd.Function):
    """Head shards back to sequence shards; See the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
        ctx.sp = sp
        return _to_sequence(x, sp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _to_heads(grad, ctx.sp), None


class SumOverGroup(torch.autograd.Function):
    """``x`` summed over the SP group on every rank; the backward sums the gradients likewise."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
        ctx.sp = sp
        out = x.detach().clone()
        dist.all_reduce(out, group=sp.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.sp.group)
        return grad, None


def sum_over_group(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """A tensor that needs no gradient summed over the SP group (a token count)."""
    out = x.detach().clone()
    dist.all_reduce(out, group=sp.group)
    return out


def gather_sequence(x: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """[b, s/N] -> [b, s], without gradient (position ids for attention kernels that read them)."""
    parts = [torch.empty_like(x) for _ in range(sp.size)]
    dist.all_gather(parts, x.contiguous(), group=sp.group)
    return torch.cat(parts, dim=1)
