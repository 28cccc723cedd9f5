"""Memory report: model-state bytes this rank actually holds, by category and location.

Measured from the tensors the engine and the optimizer hold (each storage counted
once), not from a formula, so tests can compare it with the ZeRO formula in
``estimate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per category (params, grads, master, optimizer_state) and per device type."""

    by_category: dict[str, int]
    by_location: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    def __str__(self) -> str:
        lines = [f"{'category':<16}{'MiB':>12}"]
        for k, v in self.by_category.items():
            lines.append(f"{k:<16}{v / 2**20:>12.3f}")
        lines.append(f"{'total':<16}{self.total / 2**20:>12.3f}")
        for loc, cats in self.by_location.items():
            lines.append(f"on {loc}: {sum(cats.values()) / 2**20:.3f} MiB")
        return "\n".join(lines)


def measure(engine, optimizer=None) -> MemoryReport:
    seen: set[tuple[int, int]] = set()
    cats = {"params": 0, "grads": 0, "master": 0, "optimizer_state": 0}
    locs: dict[str, dict[str, int]] = {}

    def add(cat: str, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() == 0 or key in seen:
            return
        seen.add(key)
        cats[cat] += storage.nbytes()
        loc = locs.setdefault(t.device.type, {k: 0 for k in cats})
        loc[cat] += storage.nbytes()

    for g in engine.groups:
        for cat, tensors in g.held_tensors().items():
            for t in tensors:
                add(cat, t)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    add("optimizer_state", v)
    return MemoryReport(cats, locs)
