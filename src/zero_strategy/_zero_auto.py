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

With the step's shape instead (``choose_preset(model, seq_len=..., batch_size=...)``, a Llama-style
transformers model), the activations are estimated per candidate (See [Note: activation memory of a
Llama-style decoder] in _estimate_activations.py), at the config's ``sequence_parallel_size`` and
tiling, with or without checkpointing as the model is set (``model.is_activation_checkpointing``;
``is_gradient_checkpointing`` before transformers 5). When they do not fit beside a preset's model
states, the activation tools are tried at that preset before the next preset, each adding to the one
before: the tiled loss, then the tiled MLP, then (checkpointing on and a GPU present) activation
offload. Tiling recomputes the head or the MLP once in backward, which costs less than the next
preset's traffic or an offloaded step; activation offload moves L layer inputs over PCIe each way.
The sequence-parallel degree is never changed: at sp N, N ranks share each sample, so a step trains
on other data; when nothing fits and a larger degree would, the error says which. Setup does the
same when the config names the shape (``{"preset": "zero_auto", "seq_len": 32768}``, with
``batch_size`` sequences per rank); without it, activations are left to the headroom.

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

from ._estimate_activations import ActivationEstimate, estimate_activations
from ._mechanisms.available_memory import HEADROOM, host_available_bytes, human_bytes
from .config import NVMeOffload, ZeroConfig, ZeroConfigError
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
               available: AvailableMemory, headroom: float = HEADROOM, activations: int = 0,
               host_activations: int = 0) -> list[Candidate]:
    """Each candidate preset with its per-rank totals and whether it fits (see [Note: zero_auto]);
    ``activations``: bytes per rank the step's activations add on the device (0: left to the headroom);
    ``host_activations``: those activation offload keeps in host memory."""
    out = []
    for name in CANDIDATES:
        cfg = _resolved(config, name)
        est = estimate_memory(num_params, frozen_params=frozen, world_size=world_size, config=cfg, units=units,
                              activations=activations)
        device, host = est.peak_device, est.peak_host + host_activations
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
                          offload_params=fields.offload_params, auto=False, seq_len=None, batch_size=1)


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


@dataclass(frozen=True)
class Workload:
    """One step's shape on a rank, for the activation estimate: ``batch_size`` sequences of
    ``seq_len`` tokens (the whole sequence: sequence parallelism divides it) through ``hf_config``'s
    decoder, with one checkpoint per layer or none."""

    hf_config: object
    batch_size: int
    seq_len: int
    checkpointing: bool

    @classmethod
    def of(cls, model: torch.nn.Module, seq_len: int, batch_size: int = 1) -> "Workload":
        """The shape of ``model``'s first transformers model (the outermost module with a ``config``
        naming a ``model_type``); refused, naming the fix, for a model that has none."""
        for module in model.modules():
            hf_config = getattr(module, "config", None)
            if getattr(hf_config, "model_type", None):
                text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
                # transformers 5 renamed the flag and warns on the old name; 4.x has only the old one
                flag = ("is_activation_checkpointing" if hasattr(type(module), "is_activation_checkpointing")
                        else "is_gradient_checkpointing")
                checkpointing = bool(getattr(module, flag, False))
                return cls(text, batch_size, seq_len, checkpointing)
        raise ZeroConfigError("seq_len", f"the activation estimate needs a Hugging Face transformers model; "
                              f"{type(model).__name__} holds none",
                              "Pass activations= (bytes per rank) instead of seq_len=.")

    def activations(self, config: ZeroConfig) -> ActivationEstimate:
        impl = getattr(self.hf_config, "_attn_implementation", None)
        return estimate_activations(self.hf_config, self.batch_size, self.seq_len, config.precision,
                                    "eager" if impl == "eager" else "sdpa",  # flash saves what sdpa does
                                    tiled_loss=config.tiled_loss, tiled_mlp=config.tiled_mlp,
                                    sequence_parallel_size=config.sequence_parallel_size,
                                    activation_offload=config.activation_offload and self.checkpointing)


def activation_tools(config: ZeroConfig, workload: Workload, available: AvailableMemory) -> list[dict]:
    """The config's own activation settings, then each tool it lacks added to the ones before
    (See [Note: zero_auto]): ``[{}, {"tiled_loss": True}, {"tiled_loss": True, "tiled_mlp": True}, ...]``."""
    tools, added = [{}], {}
    steps = [("tiled_loss", config.tiled_loss is False), ("tiled_mlp", config.tiled_mlp is False),
             ("activation_offload", not config.activation_offload and workload.checkpointing
              and available.device is not None)]  # on a CPU-only run the inputs are in host memory already
    for name, missing in steps:
        if missing:
            added = {**added, name: True}
            tools.append(added)
    return tools


def _first_fit(num_params, frozen, units, config, world_size, available, headroom, workload):
    """(preset row, activation tools, estimate) of the first preset and tools that fit, by [Note: zero_auto]'s
    order, or None; and for each activation setting tried, (tools, estimate, the candidates' rows)."""
    tools = activation_tools(config, workload, available)
    tables = []
    for extra in tools:
        act = workload.activations(config.replace(**extra))
        rows = candidates(num_params, frozen, units, config.replace(**extra), world_size, available, headroom,
                          act.peak(workload.checkpointing), act.host_bytes)
        tables.append((extra, act, rows))
    for index in range(len(CANDIDATES)):
        for extra, act, rows in tables:
            if rows[index].fits:
                return (rows[index], extra, act), tables
    return None, tables


def _describe(extra: dict) -> str:
    return " + ".join(f"{name}=True" for name in extra) or "the config's own activation settings"


def _sp_would_fit(num_params, frozen, units, config, world_size, available, headroom, workload) -> str:
    """A sentence naming the smallest larger sequence-parallel degree that would fit, or ''."""
    heads = getattr(workload.hf_config, "num_attention_heads", 0)
    kv = getattr(workload.hf_config, "num_key_value_heads", None) or heads
    for n in range(config.sequence_parallel_size + 1, world_size + 1):
        # the degrees setup would take: dividing the world, the heads, and the kv heads (or divided by them)
        if world_size % n or heads % n or (kv >= n and kv % n) or (kv < n and n % kv):
            continue
        found, _ = _first_fit(num_params, frozen, units, config.replace(sequence_parallel_size=n), world_size,
                              available, headroom, workload)
        if found is not None:
            row, extra, _ = found
            return (f" sequence_parallel_size={n} would fit ({row.name} with {_describe(extra)}); zero_auto does "
                    f"not change it, because {n} ranks then share each sample and a step trains on other data: "
                    "set it yourself.")
    return ""


def choose(model: torch.nn.Module, config: ZeroConfig, world_size: int, available: AvailableMemory,
           rank: int = 0, headroom: float = HEADROOM, activations: int = 0,
           workload: Workload | None = None) -> ZeroConfig:
    """The config of the first candidate that fits, logged on rank 0; raises when none does.
    ``workload``: estimate the activations per candidate and add activation tools where they do
    not fit (See [Note: zero_auto]); ``activations`` is then not given."""
    num_params, frozen = count_parameters(model)
    units = unit_sizes(model, config.unit_classes, config.param_persistence_threshold)
    if workload is None:
        rows = candidates(num_params, frozen, units, config, world_size, available, headroom, activations)
        chosen, extra, why = next((r for r in rows if r.fits), None), {}, ""
    else:
        found, tables = _first_fit(num_params, frozen, units, config, world_size, available, headroom, workload)
        if found is not None:  # the table of the activation settings chosen
            chosen, extra, _ = found
            rows = next(r for e, _, r in tables if e == extra)
        else:  # the table with every tool: what is still missing
            chosen, extra, rows = None, {}, tables[-1][2]
        why = _explain(workload, tables, chosen, extra, config)
    table = format_candidates(rows, available, headroom)
    if chosen is None:
        hint = "" if workload is None else _sp_would_fit(num_params, frozen, units, config, world_size, available,
                                                          headroom, workload)
        raise MemoryError(f"zero_strategy: zero_auto found no preset whose model states and working set fit "
                          f"({num_params:,} trainable + {frozen:,} frozen parameters, {world_size} rank(s)).\n"
                          f"{table}\n{why}{shortfall_message(rows, available, headroom)}{hint}")
    if rank == 0:
        logger.info("%s\n%szero_auto chose %s%s", table, why, chosen.name,
                    f" with {_describe(extra)}" if extra else "")
    return _resolved(config, chosen.name).replace(**extra)


def _explain(workload: Workload, tables, chosen: Candidate | None, extra: dict, config: ZeroConfig) -> str:
    """One line per activation setting tried: its bytes per rank; empty when the config's own fit."""
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    if chosen is not None and not extra and tables[0][2][0].fits:
        return ""
    sp = config.sequence_parallel_size
    lines = [f"zero_auto: activations of {workload.batch_size} x {workload.seq_len} tokens per step"
             + (f", split over {sp} sequence-parallel ranks" if sp > 1 else "")
             + (", one checkpoint per layer" if workload.checkpointing else ", no checkpointing") + ":"]
    for tools, act, _ in tables:
        host = f" (+ {gib(act.host_bytes)} in host memory)" if act.host_bytes else ""
        lines.append(f"  {_describe(tools)}: {gib(act.peak(workload.checkpointing))} per rank on the device{host}")
    return "\n".join(lines) + "\n"


def resolve(model: torch.nn.Module, config: ZeroConfig, comm, device: torch.device) -> ZeroConfig:
    """``config`` itself unless it is ``zero_auto``; then the chosen preset's config."""
    if not config.auto:
        return config
    workload = None if config.seq_len is None else Workload.of(model, config.seq_len, config.batch_size)
    return choose(model, config, comm.world_size, measure_available(comm, device, config), rank=comm.rank,
                  workload=workload)
