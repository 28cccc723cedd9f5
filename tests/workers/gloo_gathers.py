"""Gathers on gloo, three ranks: values, what the process holds during the call, subgroups.

Each rank r fills its shard with a value that names the rank and the element (``r * 1000 + i``,
exact in every dtype used here), so the expected whole is known without any collective.
Reports per case: whether the gathered values are exact, and for the memory case the peak
anonymous memory (RssAnon, glibc returning freed blocks at once: tests/_rss.py) during one
all-gather into an output allocated and touched before it.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from _rss import anon_rss, return_freed_memory_to_the_os
from _worker import finish, start

from zero_strategy._comm.collectives import Collectives


def shard_of(rank: int, size: int, dtype) -> torch.Tensor:
    return (rank * 1000 + torch.arange(size)).to(dtype)


def whole(ranks: list[int], size: int, dtype) -> torch.Tensor:
    return torch.cat([shard_of(r, size, dtype) for r in ranks])


def all_gather_cases(comm: Collectives, ranks: list[int], me: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for size in (1, 7, 1000):
            n = len(ranks)
            # the shard as a tensor of its own
            full = torch.full((n * size,), -1).to(dtype)
            comm.all_gather(full, shard_of(me, size, dtype), async_op=False, label="own")
            ok = torch.equal(full, whole(ranks, size, dtype))
            # the shard as a view of the output's own slot (the engine's stage-3 gathers)
            full2 = torch.full((n * size,), -1).to(dtype)
            slot = full2.view(n, size)[comm.rank]
            slot.copy_(shard_of(me, size, dtype))
            handle = comm.all_gather(full2, slot, async_op=True, label="view")
            handle.wait()
            out[f"{dtype}-{size}"] = ok and torch.equal(full2, whole(ranks, size, dtype))
    return out


def pieces_case(comm: Collectives, ranks: list[int], me: int, dst: int) -> bool:
    """Each rank's shard of 10 elements cut at 3 and 8; ``dst`` receives into three separate
    tensors per rank; the others send."""
    size = 10
    mine = shard_of(me, size, torch.float32)
    cuts = [(0, 3), (3, 8), (8, 10)]
    if comm.rank != dst:
        comm.pieces_to([mine[a:b] for a, b in cuts], None, dst, size * len(ranks), label="pieces").wait()
        return True
    got = {k: [torch.empty(b - a) for a, b in cuts] for k in range(len(ranks)) if k != dst}
    comm.pieces_to([], got, dst, size * len(ranks), label="pieces").wait()
    return all(torch.equal(torch.cat(got[k]), shard_of(ranks[k], size, torch.float32)) for k in got)


def gather_to_case(comm: Collectives, ranks: list[int], me: int, dst: int) -> bool:
    size = 5
    out = torch.empty(size * len(ranks)) if comm.rank == dst else None
    comm.gather_to(out, shard_of(me, size, torch.float32), dst, label="to")
    return out is None or torch.equal(out, whole(ranks, size, torch.float32))


def memory_case(comm: Collectives, me: int) -> dict:
    """Peak anonymous memory above the output's own during one 48 MiB fp32 all-gather."""
    n = comm.world_size
    size = (48 << 20) // 4 // n
    full = torch.zeros(n * size)  # allocated and touched before: it counts in ``before``
    shard = shard_of(me, size, torch.float32)
    peak, stop = [anon_rss()], threading.Event()

    def sample():
        while not stop.wait(0.001):
            peak[0] = max(peak[0], anon_rss())
    thread = threading.Thread(target=sample, daemon=True)
    dist.barrier()
    before = anon_rss()
    thread.start()
    comm.all_gather(full, shard, async_op=False, label="memory")
    stop.set()
    thread.join()
    peak[0] = max(peak[0], anon_rss())
    return {"output_bytes": full.numel() * 4, "grown": peak[0] - before,
            "exact": bool(torch.equal(full[size:2 * size], shard_of(1, size, torch.float32)))}


def main() -> None:
    args, out = start()
    return_freed_memory_to_the_os()
    me = dist.get_rank()
    world = Collectives(None, wait_timeout=60)
    ranks = list(range(dist.get_world_size()))
    report = {"rank": me, "all_gather": all_gather_cases(world, ranks, me),
              "pieces": [pieces_case(world, ranks, me, dst) for dst in ranks],
              "gather_to": [gather_to_case(world, ranks, me, dst) for dst in ranks],
              "memory": memory_case(world, me)}
    sub_ranks = [1, 2]
    sub = dist.new_group(sub_ranks)  # every rank creates it; ranks 1 and 2 use it
    if me in sub_ranks:
        comm = Collectives(sub, wait_timeout=60)
        report["sub"] = {"all_gather": all_gather_cases(comm, sub_ranks, me),
                         "pieces": [pieces_case(comm, sub_ranks, me, dst) for dst in (0, 1)],
                         "gather_to": [gather_to_case(comm, sub_ranks, me, dst) for dst in (0, 1)]}
    finish(out, report)


if __name__ == "__main__":
    main()
