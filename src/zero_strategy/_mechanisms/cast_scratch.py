"""Host buffers the optimizer step casts gradients into, kept from one step to the next.

[Note: the step's casts reuse their buffers]
With bf16 (or fp16) gradients the optimizer still needs an fp32 ``.grad`` beside each fp32
master, so every host step casts: a step batch of groups, a chunk of a streamed group, or a
whole owned group. Cast with ``tensor.to(torch.float32)``, each cast allocates, and what one
step freed is what the next one allocates again: glibc either keeps it (the process grows
by the freed copies, in the step worker's arena, 40-140 MiB per group on the 748M Llama
of benchmarks/memory_lifecycle.py) or, once it is given back to the OS, faults every page of
it in again at the next step (See [Note: freed host memory] in host_memory.py: that round trip
made the offloaded step half as fast). So the casts write into buffers leased from here and
handed back after the step of their batch: one buffer per concurrent lease (the CPU step
has one worker, so in practice one), grown to the largest request and reused by every
later step without a fault. It is part of the working set ("staging"), and is freed where
a phase ends (a save, a load, an eval after training), as the NVMe staging slots are.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

from .working_set import WorkingSet


class CastScratch:
    """Reusable host buffers for the step's gradient casts (See [Note: the step's casts reuse
    their buffers])."""

    def __init__(self, working_set: WorkingSet | None = None):
        self._working_set = working_set
        self._lock = threading.Lock()
        self._idle: list[torch.Tensor] = []  # buffers no lease holds
        self._held_bytes = 0  # every buffer this pool owns, leased or idle

    @contextlib.contextmanager
    def lease(self, numel: int, dtype: torch.dtype) -> Iterator[torch.Tensor | None]:
        """A host tensor of ``numel`` elements of ``dtype`` (uninitialized) until the block ends;
        None for no elements."""
        if numel == 0:
            yield None
            return
        with self._lock:
            fits = [b for b in self._idle if b.dtype == dtype and b.numel() >= numel]
            buf = min(fits, key=torch.Tensor.numel) if fits else None
            if buf is not None:
                self._idle.remove(buf)
            elif self._idle:  # outgrown: the largest idle one makes way for a larger one
                small = max(self._idle, key=lambda b: b.numel() * b.element_size())
                self._idle.remove(small)
                self._account(-small.numel() * small.element_size())
                del small
        if buf is None:
            buf = torch.empty(numel, dtype=dtype)
            with self._lock:
                self._account(buf.numel() * buf.element_size())
        try:
            yield buf[:numel]
        finally:
            with self._lock:
                self._idle.append(buf)

    def release(self) -> None:
        """Free the buffers no lease holds (a phase ended: the next step allocates again)."""
        with self._lock:
            freed = sum(b.numel() * b.element_size() for b in self._idle)
            self._idle.clear()
            self._account(-freed)

    @property
    def nbytes(self) -> int:
        return self._held_bytes

    def _account(self, delta: int) -> None:
        self._held_bytes += delta
        if self._working_set is not None and delta:
            (self._working_set.add if delta > 0 else self._working_set.remove)("staging", abs(delta))


def carve(scratch: torch.Tensor | None) -> Callable[[int], torch.Tensor | None]:
    """Hands out consecutive pieces of a leased ``scratch``: ``take(n)`` is the next ``n``
    elements (None for none, or without a scratch)."""
    start = 0

    def take(n: int) -> torch.Tensor | None:
        nonlocal start
        if scratch is None or n == 0:
            return None
        start += n
        return scratch[start - n:start]
    return take
