"""``zero_auto``: the least-offloaded preset whose memory at its peak fits this machine.

[Note: zero_auto]
At setup, with the model in hand (materialised or on the meta device: only ``numel`` is
read), each candidate's per-rank peak is estimated with :func:`estimate_memory`: the
ZeRO paper's resting model states plus the working set a step adds (the stage-3
gathered window, the gradient buckets, the staging buffers as the config sizes them;
See [Note: the estimated working set] in _estimate_working_set.py), ``peak_device`` and
``peak_host``, and compared with what this rank has:

* device: free memory of this rank's CUDA device (``torch.cuda.mem_get_info``);
* host: ``MemAvailable`` of ``/proc/meminfo`` (``os.sysconf`` where there is none),
  divided among the ranks on the same host (found by exchanging host names);
* NVMe: free space where NVMe offload would write (the config's path,
  ``ZERO_STRATEGY_NVME_PATH``, or the per-user default), divided the same way.

A CPU-only run has one pool: its device and host totals are added and compared with the
host share. Every rank takes the minimum over all ranks of each figure, so all choose
the same preset (a rank at another stage would deadlock the first collective).

A candidate fits when each total is at most ``1 - headroom`` of what is available;
``headroom`` is 0.25: the margin for activations, the collectives' own temporary
buffers (a coalesced reduce's packed input) and allocator fragmentation, which the
estimate does not count. Activations can be estimated with ``zero-strategy estimate --batch-size
--seq-len`` (``--tiled-loss`` for the tiled loss); a run whose activations take more than a
quarter of the device should pass them to ``choose_preset(model, activations=...)``, which counts
them on the device beside the model states, and set up with the preset it returns.

Order (the first that fits is chosen): zero2, zero3, zero2_offload, zero3_offload,
zero3_offload_nvme. No offload first: offload runs the optimizer step on the CPU and
copies gradients and parameters over PCIe every step (DeepSpeed's ZeRO-2 offload takes
about 2.7x its GPU-only step on one GPU: 0.759 s against 0.284 s), while stage 3 adds one parameter all-gather (1.5x
the traffic of stages 1-2). zero1 is not a candidate: zero2 has the same traffic,
reduces during backward and holds less.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from ._mechanisms.available_memory import HEADROOM, host_available_bytes, human_bytes
from .config import NVMeOffload, ZeroConfig
from .estimate import MemoryEstimate, UnitSizes, count_parameters, estimate_memory, unit_sizes

logger = logging.getLogger("zero_strategy")

CANDIDATES = ("zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_offload_nvme")


@dataclass(frozen=True)
class AvailableMemory:
    """Bytes one rank may use. ``device`` is None on a CPU-only run (the device is host memory);
    ``nvme`` is None where the NVMe directory's disk cannot be measured."""

    device: int | None
    host: int
    nvme: int | None = None


@dataclass(frozen=True)
class Candidate:
    name: str
    estimate: MemoryEstimate
    device: int  # bytes the device would hold at its peak: model states + working set (0 on CPU-only)
    host: int
    nvme: int
    fits: bool


def nvme_free_bytes(config: ZeroConfig) -> int | None:
    """Free space of the disk NVMe offload would write to (its nearest existing directory)."""
    from ._mechanisms.nvme_files import default_base

    policy = config.offload_optimizer if isinstance(config.offload_optimizer, NVMeOffload) else None
    path = Path((policy.path if policy else None) or os.environ.get("ZERO_STRATEGY_NVME_PATH") or default_base())
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return None


def measure_local(device: torch.device, config: ZeroConfig, local_ranks: int = 1) -> AvailableMemory:
    """This process's share, without any collective: host and NVMe divided by ``local_ranks``."""
    dev = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    nvme = nvme_free_bytes(config)
    return AvailableMemory(device=dev, host=host_available_bytes() // local_ranks,
                           nvme=None if nvme is None else nvme // local_ranks)


def measure_available(comm, device: torch.device, config: ZeroConfig) -> AvailableMemory:
    """This rank's share of device, host and NVMe memory, the minimum over the group's ranks."""
    local = measure_local(device, config)
    mine = (socket.gethostname(), local.device, local.host, local.nvme)
    everyone = comm.all_gather_object(mine)
    per_host = {}
    for host, *_ in everyone:
        per_host[host] = per_host.get(host, 0) + 1
    shares = [(d, h // per_host[name], None if n is None else n // per_host[name]) for name, d, h, n in everyone]
    devices = [d for d, _, _ in shares if d is not None]
    nvmes = [n for _, _, n in shares if n is not None]
    return AvailableMemory(device=min(devices) if devices else None, host=min(h for _, h, _ in shares),
                           nvme=min(nvmes) if len(nvmes) == len(shares) else None)


def candidates(num_params: int, frozen: int, units: UnitSizes, config: ZeroConfig, world_size: int,
               available: AvailableMemory, headroom: float = HEADROOM, activations: int = 0) -> list[Candidate]:
    """Each candidate preset with its per-rank totals and whether it fits (see [Note: zero_auto]);
    ``activations``: bytes per rank the step's activations add on the device (0: left to the headroom)."""
    out = []
    for name in CANDIDATES:
        cfg = _resolved(config, name)
        est = estimate_memory(num_params, frozen_params=frozen, world_size=world_size, config=cfg, units=units,
                              activations=activations)
        device, host = est.peak_device, est.peak_host
        if available.device is None:  # one pool: the "device" is host memory
            device, host = 0, device + host
        budget = lambda b: (1 - headroom) * b  # noqa: E731
        fits = (host <= budget(available.host)
                and (available.device is None or device <= budget(available.device))
                and (est.nvme_bytes == 0 or (available.nvme is not None and est.nvme_bytes <= budget(available.nvme))))
        out.append(Candidate(name, est, device, host, est.nvme_bytes, fits))
    return out


def _resolved(config: ZeroConfig, name: str) -> ZeroConfig:
    fields = ZeroConfig.preset(name)
    return config.replace(stage=fields.stage, offload_optimizer=fields.offload_optimizer,
                          offload_params=fields.offload_params, auto=False)


def format_candidates(rows: list[Candidate], available: AvailableMemory, headroom: float = HEADROOM) -> str:
    dev = "cpu-only (device = host)" if available.device is None else human_bytes(available.device)
    nvme = "n/a" if available.nvme is None else human_bytes(available.nvme)
    lines = [f"zero_auto: available per rank: device {dev}, host {human_bytes(available.host)}, nvme {nvme}; "
             f"model states + working set may use {1 - headroom:.0%} of each",
             f"  {'preset':<20}{'device':>12}{'host':>12}{'nvme':>12}  fits"]
    lines += [f"  {r.name:<20}{human_bytes(r.device):>12}{human_bytes(r.host):>12}{human_bytes(r.nvme):>12}  "
              f"{'yes' if r.fits else 'no'}" for r in rows]
    return "\n".join(lines)


def shortfall_message(rows: list[Candidate], available: AvailableMemory, headroom: float = HEADROOM) -> str:
    """What more memory would let the most-offloaded presets fit, per rank."""
    need = lambda used, have: max(0, math.ceil(used / (1 - headroom) - (have or 0)))  # noqa: E731
    by_name = {r.name: r for r in rows}
    parts = []
    for name in ("zero3_offload", "zero3_offload_nvme"):
        row, extra = by_name[name], []
        if need(row.host, available.host):
            extra.append(f"{human_bytes(need(row.host, available.host))} more host memory")
        if row.nvme and need(row.nvme, available.nvme):
            extra.append(f"{human_bytes(need(row.nvme, available.nvme))} more NVMe space"
                         + ("" if available.nvme is not None else " (no NVMe directory could be measured: set "
                            "ZERO_STRATEGY_NVME_PATH)"))
        if available.device is not None and need(row.device, available.device):
            extra.append(f"{human_bytes(need(row.device, available.device))} more device memory")
        parts.append(f"{name} would fit with " + (" and ".join(extra) or "nothing more") + " per rank")
    return ("; ".join(parts) + ". More ranks shrink every sharded term, not the stage-3 gathered units "
            "(name smaller units with unit_classes).")


def choose(model: torch.nn.Module, config: ZeroConfig, world_size: int, available: AvailableMemory,
           rank: int = 0, headroom: float = HEADROOM, activations: int = 0) -> ZeroConfig:
    """The config of the first candidate that fits, logged on rank 0; raises when none does."""
    num_params, frozen = count_parameters(model)
    units = unit_sizes(model, config.unit_classes, config.param_persistence_threshold)
    rows = candidates(num_params, frozen, units, config, world_size, available, headroom, activations)
    table = format_candidates(rows, available, headroom)
    chosen = next((r for r in rows if r.fits), None)
    if chosen is None:
        raise MemoryError(f"zero_strategy: zero_auto found no preset whose model states and working set fit "
                          f"({num_params:,} trainable + {frozen:,} frozen parameters, {world_size} rank(s)).\n"
                          f"{table}\n{shortfall_message(rows, available, headroom)}")
    if rank == 0:
        logger.info("%s\nzero_auto chose %s", table, chosen.name)
    return _resolved(config, chosen.name)


def resolve(model: torch.nn.Module, config: ZeroConfig, comm, device: torch.device) -> ZeroConfig:
    """``config`` itself unless it is ``zero_auto``; then the chosen preset's config."""
    if not config.auto:
        return config
    return choose(model, config, comm.world_size, measure_available(comm, device, config), rank=comm.rank)
