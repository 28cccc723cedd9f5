"""Whether a planned run fits the machine it is planned on: its memory, and its disks.

``zero-strategy estimate --this-machine`` answers the question a person asks before a run
that takes hours (or a model bigger than the machine's memory, on NVMe): will the ranks of
this machine fit in its memory, and will the swap files, the checkpoint and the export fit
on its disks? An estimate (estimate.py) gives one rank's model states and working set; this
module multiplies by the ranks on this machine and sets the sums beside what the machine has
free now: ``MemAvailable`` (and each GPU's free memory), and the free space of the disks the
NVMe directory and the save directory are on (one sum where they are the same disk).

The memory verdict keeps the headroom ``zero_auto`` keeps (HEADROOM of what is available is
left for activations the estimate was not told about, the allocator's slack, the page
cache), so ``estimate --this-machine`` and ``zero_auto`` say the same thing. The disk
verdict has no headroom: a file system holds what it says it has free.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from ._mechanisms.available_memory import HEADROOM, host_available_bytes, human_bytes


@dataclass(frozen=True)
class MachineFit:
    """One setup's needs on this machine beside what the machine has free (bytes).

    ``memory_needed``: the ranks' host memory together (on a machine without a GPU the
    device's share too: it is host memory). ``gpu_needed`` / ``gpu_free``: per GPU, None
    without one. ``swap_disk``: every rank's NVMe swap files; ``save_disk``: one checkpoint
    and one export. ``*_free``: None where the path's disk could not be measured.
    """

    ranks: int
    memory_needed: int
    memory_available: int
    gpu_needed: int | None
    gpu_free: int | None
    swap_disk: int
    swap_free: int | None
    save_disk: int
    save_free: int | None
    same_disk: bool

    @property
    def fits_memory(self) -> bool:
        return (self.memory_needed <= (1 - HEADROOM) * self.memory_available
                and (self.gpu_needed is None or self.gpu_free is None
                     or self.gpu_needed <= (1 - HEADROOM) * self.gpu_free))

    @property
    def fits_disk(self) -> bool:
        if self.same_disk:
            return self.swap_free is not None and self.swap_disk + self.save_disk <= self.swap_free
        swap_ok = self.swap_disk == 0 or (self.swap_free is not None and self.swap_disk <= self.swap_free)
        return swap_ok and self.save_free is not None and self.save_disk <= self.save_free

    @property
    def fits(self) -> bool:
        return self.fits_memory and self.fits_disk

    def shortfalls(self) -> list[str]:
        """What does not fit, in words (empty when it all fits)."""
        out = []
        if not self.fits_memory:
            if self.memory_needed > (1 - HEADROOM) * self.memory_available:
                out.append(f"memory: {human_bytes(self.memory_needed)} needed, {human_bytes(self.memory_available)} "
                           f"available (with {HEADROOM:.0%} kept free)")
            if self.gpu_needed is not None and self.gpu_free is not None \
                    and self.gpu_needed > (1 - HEADROOM) * self.gpu_free:
                out.append(f"GPU memory: {human_bytes(self.gpu_needed)} needed per GPU, "
                           f"{human_bytes(self.gpu_free)} free (with {HEADROOM:.0%} kept free)")
        if not self.fits_disk:
            if self.same_disk:
                out.append(f"disk: {human_bytes(self.swap_disk + self.save_disk)} needed (swap files, checkpoint, "
                           f"export), {_free(self.swap_free)} free")
            else:
                if self.swap_disk and (self.swap_free is None or self.swap_disk > self.swap_free):
                    out.append(f"NVMe disk: {human_bytes(self.swap_disk)} of swap files, {_free(self.swap_free)} free")
                if self.save_free is None or self.save_disk > self.save_free:
                    out.append(f"save disk: {human_bytes(self.save_disk)} (checkpoint and export), "
                               f"{_free(self.save_free)} free")
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "fits_memory": self.fits_memory, "fits_disk": self.fits_disk, "fits": self.fits}


def _free(nbytes: int | None) -> str:
    return "an unknown amount" if nbytes is None else human_bytes(nbytes)


def existing_ancestor(path: str | os.PathLike) -> Path | None:
    """``path`` or its nearest existing parent: where a directory not made yet will live."""
    target = Path(path).expanduser().absolute()
    for candidate in (target, *target.parents):
        if candidate.exists():
            return candidate
    return None


def disk_free(path: str | os.PathLike) -> int | None:
    """Free bytes of the disk ``path`` (or the directory it will be made in) is on."""
    where = existing_ancestor(path)
    return None if where is None else shutil.disk_usage(where).free


def same_disk(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths (or the directories they will be made in) are on one file system."""
    pa, pb = existing_ancestor(a), existing_ancestor(b)
    return pa is not None and pb is not None and os.stat(pa).st_dev == os.stat(pb).st_dev


def gpu_free_bytes() -> int | None:
    """The least free memory of this machine's GPUs; None without one."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    return min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))


def fit_on_this_machine(estimate, ranks: int, nvme_path: str | os.PathLike, save_dir: str | os.PathLike, *,
                        activation_bytes: int = 0, memory_available: int | None = None,
                        gpu_free: int | None = None, has_gpu: bool | None = None) -> MachineFit:
    """``estimate`` (one rank's :class:`~zero_strategy.estimate.MemoryEstimate`) times the ``ranks``
    on this machine, beside its free memory and disks. ``activation_bytes``: one rank's
    activations, when known. ``memory_available`` / ``gpu_free`` / ``has_gpu``: the machine's
    figures (measured here when None)."""
    if has_gpu is None:
        gpu_free = gpu_free_bytes() if gpu_free is None else gpu_free
        has_gpu = gpu_free is not None
    device = estimate.peak_device if estimate.peak_device is not None else estimate.total_device
    host = estimate.peak_host if estimate.peak_host is not None else estimate.total_host
    if has_gpu:
        memory_needed, gpu_needed = ranks * host, device + activation_bytes
    else:  # one memory: the device's share is host memory too
        memory_needed, gpu_needed = ranks * (host + device + activation_bytes), None
    available = host_available_bytes() if memory_available is None else memory_available
    return MachineFit(ranks=ranks, memory_needed=memory_needed, memory_available=available,
                      gpu_needed=gpu_needed, gpu_free=gpu_free if has_gpu else None,
                      swap_disk=ranks * estimate.nvme_bytes, swap_free=disk_free(nvme_path),
                      save_disk=estimate.checkpoint_bytes + estimate.export_bytes, save_free=disk_free(save_dir),
                      same_disk=same_disk(nvme_path, save_dir))
