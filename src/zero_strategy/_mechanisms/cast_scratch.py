"""Host buffers the optimizer step casts gradients into, kept from one step to the next.

[Note: the step's casts reuse their buffers]
With bf16 (or fp16) gradients the optimizer still needs an fp32 ``.grad`` beside each fp32
master, so every host step casts: a step batch of groups, a chunk of a streamed group, or a
whole owned group. Cast with ``tensor.to(torch.float32)``, each cast allocates, and what one
step freed is what the next one allocates again: glibc either keeps it (the process grows
by the freed copies, in the step worker's arena, 40-140 MiB per group on the 748M Llama
of benchmarks/memory_lifecycle.py) or, once it is given back to the OS, faults every page of
it in again at the next step (See [Note: freed host memory] in memory.py: that round trip
made the offloaded step half as fast). So the casts write into buffers taken from here and
given back after the step of their batch: one buffer per concurrent step (the CPU step has
one worker, so in practice one), grown to the largest request and reused by every later step
without a fault. A buffer something still refers to when it comes back (a gradient an
optimizer kept) is not reused, so nothing changes under its holder. ``memory_report(model).kept_bytes`` counts it, and it is freed where
a phase ends (a save, a load, an eval after training), as the NVMe staging slots are.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from .memory import storage_use_count


class CastScratch:
    """Reusable host buffers for the step's gradient casts (See [Note: the step's casts reuse
    their buffers]). ``take`` a buffer, cast into slices of it, drop those slices, then
    ``give_back`` the buffer: one still referred to (a gradient an optimizer kept) is not reused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[torch.Tensor] = []  # buffers no one holds
        self._held_bytes = 0  # every buffer this pool owns, taken or idle

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A host buffer of at least ``numel`` elements of ``dtype`` (uninitialized); None for none."""
        if numel == 0:
            return None
        with self._lock:
            fits = [b for b in self._idle if b.dtype == dtype and b.numel() >= numel]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._forget(buf)
                return buf
            if self._idle:  # outgrown: the largest idle one makes way for a larger one
                small = max(self._idle, key=lambda b: b.numel() * b.element_size())
                self._forget(small)
                self._held_bytes -= small.numel() * small.element_size()
                del small
        buf = torch.empty(numel, dtype=dtype)
        with self._lock:
            self._held_bytes += buf.numel() * buf.element_size()
        return buf

    def _forget(self, buf: torch.Tensor) -> None:
        """Take ``buf`` off the idle list, by identity (``list.remove`` would compare tensors with ``==``)."""
        self._idle = [b for b in self._idle if b is not buf]

    def give_back(self, buf: torch.Tensor | None) -> None:
        """``buf`` (from :meth:`take`) is no longer used by the step: keep it, unless something
        still refers to its memory (then it is freed by its last holder, as any tensor)."""
        if buf is None:
            return
        with self._lock:
            if storage_use_count(buf) == 1:
                self._idle.append(buf)
            else:
                self._held_bytes -= buf.numel() * buf.element_size()

    def release(self) -> None:
        """Free the buffers no one holds (a phase ended: the next step allocates again)."""
        with self._lock:
            self._held_bytes -= sum(b.numel() * b.element_size() for b in self._idle)
            self._idle.clear()

    @property
    def nbytes(self) -> int:
        return self._held_bytes


def carve(scratch: torch.Tensor | None) -> Callable[[int], torch.Tensor | None]:
    """Hands out consecutive pieces of a taken ``scratch``: ``take(n)`` is the next ``n``
    elements (None for none, or without a scratch)."""
    start = 0

    def take(n: int) -> torch.Tensor | None:
        nonlocal start
        if scratch is None or n == 0:
            return None
        start += n
        return scratch[start - n:start]
    return take
