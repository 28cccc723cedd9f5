"""Memory report: model-state bytes this rank actually holds, by category and placement.

Measured from the tensors the engine and the optimizer hold (each storage counted
once), not from a formula, so tests can compare it with the ZeRO formula in
``estimate.py``. Placement is the engine's: "host" for what offload put in host
memory on purpose, "offloaded" for what ``offload_states`` moved there until
``reload_states``, "device" for the rest; ``by_location`` gives the real device
types as well (identical placements on a CPU-only machine).

Beside that resting state, the *working set* (See [Note: the working set] in
_mechanisms/memory.py): stage-3 units gathered, full gradient buffers, staging
buffers, as held now and at their peak since setup or the last ``reset_peak``. The
staging pool's buffers, an asynchronous checkpoint save's host copies (staged, or kept for
the next save) and the 16 MiB ``O_DIRECT`` staging buffer of each checkpoint file being written
(a synchronous save's too), are in both (they rest between steps), so add
``peak_working_set_bytes`` to ``total - by_category["staging"]`` for the worst moment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._mechanisms.memory import WORKING_SET_CATEGORIES

CATEGORIES = ("params", "grads", "master", "optimizer_state", "staging")


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per category, per placement ("device"/"host") and per real device type."""

    by_category: dict[str, int]
    by_placement: dict[str, dict[str, int]] = field(default_factory=dict)
    by_location: dict[str, dict[str, int]] = field(default_factory=dict)
    #: working-set bytes held when measured, per category ("gathered", "grad_buckets", "staging")
    working_set: dict[str, int] = field(default_factory=dict)
    #: each working-set category's peak since setup or the last reset_peak
    peak_working_set: dict[str, int] = field(default_factory=dict)
    #: the peak of the working set's sum (the categories' peaks need not coincide)
    peak_working_set_bytes: int = 0
    #: host buffers kept for the next step (the step's cast buffers, the training cycle's idle
    #: gradient buffers), freed where a phase ends; in neither ``total`` nor the working set
    #: (See [Note: the training cycle's host buffers] in _mechanisms/memory.py)
    kept_bytes: int = 0

    @property
    def total(self) -> int:
        return sum(self.by_category.values())

    @property
    def device_bytes(self) -> int:
        return sum(self.by_placement.get("device", {}).values())

    @property
    def host_bytes(self) -> int:
        return sum(self.by_placement.get("host", {}).values())

    @property
    def offloaded_bytes(self) -> int:
        """Bytes ``offload_states`` moved off the compute device into host memory (0 when none)."""
        return sum(self.by_placement.get("offloaded", {}).values())

    @property
    def nvme_bytes(self) -> int:
        """Bytes in this rank's NVMe swap file (0 without NVMe offload)."""
        return sum(self.by_placement.get("nvme", {}).values())

    def __str__(self) -> str:
        lines = [f"{'category':<16}{'device MiB':>12}{'host MiB':>12}"]
        for k in CATEGORIES:
            d = self.by_placement.get("device", {}).get(k, 0) / 2**20
            h = self.by_placement.get("host", {}).get(k, 0) / 2**20
            lines.append(f"{k:<16}{d:>12.3f}{h:>12.3f}")
        lines.append(f"{'total':<16}{self.device_bytes / 2**20:>12.3f}{self.host_bytes / 2**20:>12.3f}")
        if self.peak_working_set:
            lines.append("working set MiB, now / peak: " + ", ".join(
                f"{k} {self.working_set.get(k, 0) / 2**20:.3f} / {self.peak_working_set[k] / 2**20:.3f}"
                for k in WORKING_SET_CATEGORIES) + f"; peak of the sum {self.peak_working_set_bytes / 2**20:.3f}")
        if self.kept_bytes:
            lines.append(f"kept for the next step (host): {self.kept_bytes / 2**20:.3f} MiB")
        if self.offloaded_bytes:
            lines.append(f"offloaded to host by offload_states: {self.offloaded_bytes / 2**20:.3f} MiB "
                         "(reload_states brings it back)")
        return "\n".join(lines)


def measure(engine, optimizers=()) -> MemoryReport:
    seen: set[tuple[int, int]] = set()
    cats = {k: 0 for k in CATEGORIES}
    placements: dict[str, dict[str, int]] = {"device": {k: 0 for k in CATEGORIES},
                                             "host": {k: 0 for k in CATEGORIES}}
    locs: dict[str, dict[str, int]] = {}

    def add(cat: str, on_host: bool | str, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if storage.nbytes() == 0 or key in seen:
            return
        seen.add(key)
        cats[cat] += storage.nbytes()
        where = on_host if isinstance(on_host, str) else ("host" if on_host else "device")
        placements.setdefault(where, {k: 0 for k in CATEGORIES})[cat] += storage.nbytes()
        loc = locs.setdefault(t.device.type, {k: 0 for k in CATEGORIES})
        loc[cat] += storage.nbytes()

    if engine.offloaded is not None:  # first: tensors pointed at the host copies are counted there
        for cat, t in engine.offloaded.host_copies():
            add(cat, "offloaded", t)
    for g in engine.groups:
        for cat, on_host, t in g.held_tensors():
            add(cat, on_host, t)
    for optimizer in optimizers:
        offloaded = any(g.masters.steps_on_host for g in optimizer.groups)
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    add("optimizer_state", offloaded, v)
    for t in engine.transfers.staging_tensors():
        add("staging", True, t)
    for t in engine.background_save.staging_tensors():  # a save's copies until written, its writers' buffers
        add("staging", True, t)
    if engine.swap is not None:  # NVMe: the slot pool is host staging, the rest is on disk
        for t in engine.swap.staging_tensors():
            add("staging", True, t)
        placements["nvme"] = {"swap_file": engine.swap.bytes_on_disk()}
    now, peak, peak_total = engine.transfers.working_set.snapshot()
    return MemoryReport(cats, placements, locs, working_set=now, peak_working_set=peak,
                        peak_working_set_bytes=peak_total, kept_bytes=engine.transfers.kept_bytes)
