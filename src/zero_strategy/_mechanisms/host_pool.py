"""Host buffers of the training cycle, kept by size for the next step instead of freed.

[Note: the training cycle's host buffers]
Every backward allocates the same host buffers again: each group's gradient bucket (the full
unreduced gradients), its reduced gradient shard (held until ``zero_grad``), and at stage 3
each unit's gathered parameters. Allocated with ``torch.empty``, a buffer of a few MiB or more
comes from glibc as fresh pages (its own ``mmap``, or heap that glibc's free trimmed back to
the OS), so the first write into it faults every page in and the kernel zeroes it: on the
48M-parameter model of benchmarks/hot_path.py at ``zero2_offload``, the copies of autograd's
gradients into fresh buckets ran at 2 GB/s where a warm copy runs at 10, and backward took
2.2x a plain model's. So these buffers come from this pool and go back to it: a freed one is
kept under its exact size and dtype, and the next request of that size (the same group next
step, or another unit of the same shape) takes it warm. Only buffers nothing else refers to
are kept: one a view still shares (a ``param.grad`` a user holds, a gradient handed to the
optimizer) is left to be freed as before, so a kept buffer can never change under anyone.

The pool holds what the training cycle holds at its peak, no more: each kept buffer was in use
at once with the others of its kind. ``memory_report(model).kept_bytes`` shows what it keeps
(beside the resting states and the working set: a kept buffer stands where the gradients or
buckets it held stood), and the pool empties where a phase ends (See [Note: releases where a phase ends] in
host_memory.py). GPU memory needs none of this: the CUDA caching allocator keeps blocks itself.
"""

from __future__ import annotations

import threading

import torch


def storage_use_count(t: torch.Tensor) -> int | None:
    """How many tensors and storage handles refer to ``t``'s storage (None: torch cannot say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return count(t.untyped_storage()._cdata) - 1  # less the handle this call made


class HostPool:
    """Host tensors kept by (numel, dtype) for reuse (See [Note: the training cycle's host buffers])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.idle_bytes = 0

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized 1-D tensor: a kept host buffer of that size when there is one."""
        if device.type == "cpu" and numel:
            with self._lock:
                kept = self._idle.get((numel, dtype))
                if kept:
                    buf = kept.pop()
                    self._account(-buf.numel() * buf.element_size())
                    return buf
        return torch.empty(numel, dtype=dtype, device=device)

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.empty(numel, dtype, device).zero_()

    def give_back(self, t: torch.Tensor | None) -> None:
        """``t`` is no longer used by its owner: keep it for the next request of its size, unless
        it is not a whole host buffer or anything else still refers to it."""
        if t is None or t.device.type != "cpu" or t.dim() != 1 or not t.numel():
            return
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            return  # a view of a larger buffer
        if storage_use_count(t) != 1:
            return  # shared (or torch cannot tell): left to be freed by its last holder
        with self._lock:
            self._idle.setdefault((t.numel(), t.dtype), []).append(t)
            self._account(t.numel() * t.element_size())

    def release(self) -> None:
        """Free every kept buffer (a phase ended: the next step allocates again)."""
        with self._lock:
            self._idle.clear()
            self._account(-self.idle_bytes)

    def _account(self, delta: int) -> None:
        self.idle_bytes += delta
