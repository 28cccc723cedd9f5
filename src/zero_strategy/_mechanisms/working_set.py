"""The working set: what a rank holds beyond its resting shards, now and at its peak.

[Note: the working set]
``memory_report`` counts the tensors that rest (shards, masters, optimizer state); what
makes a process run out of memory is what it holds on top of them at its worst moment:
stage-3 units gathered (the prefetch window), full gradient buffers of units whose
reduce-scatter has not finished (gradient buckets), and staging buffers (NVMe slots,
pinned upload slots, a large group brought whole into memory for a checkpoint). Each of
those places reports its allocations and frees here, under one lock, a few calls per
unit or group per step (never per parameter), so the high-water mark costs nothing on
the hot path. ``reset_peak`` starts a new measurement (a phase: load, train, save).
"""

from __future__ import annotations

import threading

#: the working-set categories, in the order reports list them
WORKING_SET_CATEGORIES = ("gathered", "grad_buckets", "staging")


class WorkingSet:
    """Bytes held now per category, each category's peak, and the peak of their sum."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = {k: 0 for k in WORKING_SET_CATEGORIES}
        self.peak = dict(self.current)
        self.peak_total = 0

    def add(self, category: str, nbytes: int) -> None:
        with self._lock:
            now = self.current[category] + nbytes
            self.current[category] = now
            if now > self.peak[category]:
                self.peak[category] = now
            total = sum(self.current.values())
            if total > self.peak_total:
                self.peak_total = total

    def remove(self, category: str, nbytes: int) -> None:
        with self._lock:
            self.current[category] -= nbytes

    def replace(self, category: str, old: int, new: int) -> None:
        """One buffer of ``old`` bytes became one of ``new`` (0: none) bytes."""
        if old:
            self.remove(category, old)
        if new:
            self.add(category, new)

    def reset_peak(self) -> None:
        """The peaks start again from what is held now."""
        with self._lock:
            self.peak = dict(self.current)
            self.peak_total = sum(self.current.values())

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], int]:
        with self._lock:
            return dict(self.current), dict(self.peak), self.peak_total
