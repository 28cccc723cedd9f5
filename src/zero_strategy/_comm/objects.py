"""Small picklable objects between ranks, bounded like every other collective.

[Note: bounded object collectives]
torch's ``broadcast_object_list`` / ``all_gather_object`` wait without a bound; these pickle
into byte tensors and go through :class:`~.collectives.Collectives`' bounded calls. Like
torch's, they unpickle what the other ranks of this job sent.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist


class ObjectCollectives:
    """The object collectives of :class:`~.collectives.Collectives` (a base class of it: they use
    its ``_issue``, ``broadcast``, ``_all_gather_uncounted``, ``rank`` and groups)."""

    def _object_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast_object(self, obj: Any, src_rank: int = 0, label: str = "object") -> Any:
        """Group rank ``src_rank``'s picklable ``obj`` on every rank (checkpoint decisions)."""
        if self.world_size == 1:
            return obj
        device = self._object_device()
        data = pickle.dumps(obj) if self.rank == src_rank else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self.broadcast(size, src_rank, label=label, across_groups=False)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if self.rank == src_rank
               else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
        self.broadcast(buf, src_rank, label=label, across_groups=False)
        return obj if self.rank == src_rank else pickle.loads(buf.cpu().numpy().tobytes())

    def broadcast_object_across_groups(self, obj: Any, label: str = "object") -> Any:
        """Hybrid: the first shard group's ``obj`` on the same place of every shard group."""
        if self.replicas == 1:
            return obj
        device, group = self._object_device(), self.replicate_group
        first, is_src = dist.get_global_rank(group, 0), self.replica_index == 0
        data = pickle.dumps(obj) if is_src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self._issue("broadcast", label, size, 1, False, (size,),
                    lambda: dist.broadcast(size, src=first, group=group, async_op=True))
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if is_src
               else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
        self._issue("broadcast", label, buf, buf.numel(), False, (buf,),
                    lambda: dist.broadcast(buf, src=first, group=group, async_op=True))
        return obj if is_src else pickle.loads(buf.cpu().numpy().tobytes())

    def all_gather_object(self, obj: Any, label: str = "object") -> list:
        """Every rank's picklable ``obj``, in group-rank order."""
        n = self.world_size
        if n == 1:
            return [obj]
        device = self._object_device()
        data = pickle.dumps(obj)
        sizes = torch.zeros(n, dtype=torch.int64, device=device)
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self._all_gather_uncounted(sizes, size, label)
        width = int(sizes.max().item())
        mine = torch.zeros(width, dtype=torch.uint8, device=device)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = torch.empty(width * n, dtype=torch.uint8, device=device)
        self._all_gather_uncounted(everyone, mine, label)
        raw = everyone.cpu().numpy().tobytes()
        return [pickle.loads(raw[r * width:r * width + int(sizes[r])]) for r in range(n)]
