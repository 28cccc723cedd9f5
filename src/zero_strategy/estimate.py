"""Per-rank model-state memory of each ZeRO stage, before running anything.

The formulas are those of the ZeRO paper (Rajbhandari et al., 2020, §3 and Figure 1),
generalised to any compute/gradient dtype and optimizer. With

* Ψ trainable parameters, Ψf frozen parameters, N ranks,
* P bytes per compute-dtype element (fp32 4, bf16/fp16 2),
* G bytes per gradient (reduce-dtype) element (default P),
* M = 4 bytes of fp32 master copy when P is not fp32, else 0,
* S bytes of optimizer state per parameter (Adam 8, SGD 0, SGD+momentum 4, ...),
* K = M + S,

the per-rank model states are

| stage | bytes per rank |
|---|---|
| 0 (DDP) | (P + G + K)Ψ + PΨf |
| 1 | (P + G)Ψ + KΨ/N + PΨf |
| 2 | PΨ + (G + K)Ψ/N + PΨf |
| 3 | (P + G + K)Ψ/N + PΨf/N |

Mixed-precision Adam (P = G = 2, K = 12) gives the paper's 16Ψ, 4Ψ + 12Ψ/N,
2Ψ + 14Ψ/N and 16Ψ/N. Offloading the optimizer moves KΨ/N off the device (to host
memory, or to NVMe with pinned staging buffers in host memory) and adds a GΨ/N host
copy of the gradient shard for the CPU step (in the reduce dtype: the step casts it to
fp32 a batch or a chunk at a time). An offloaded fp32 master cannot share
storage with parameters on the device, so there M = 4 even for fp32 compute (only
fp32 stage 3 with both offloaded to host memory keeps M = 0: master and parameter
shard are then the same host tensor); offloading parameters (stage 3) moves
the (PΨ + PΨf)/N parameter shard. On a CUDA-less machine (``device="cpu"``) device
and host are one memory: an fp32 master is the parameter shard (M = 0) and the
gradient shard is stepped in place (no host copy).

Beside those resting model states, an estimate given the model (or its ``units``) counts
the *working set* a training step adds at its worst moment: the stage-3 gathered window,
the gradient buckets and the staging buffers, as the engine allocates them (See [Note: the
estimated working set] in _estimate_working_set.py), and ``peak_device`` / ``peak_host``:
resting + working set, what a rank needs. Activations are counted when given
(``activations=``: bytes, e.g. ``estimate_activations(...).peak_with_checkpointing``, which the
tiled loss lowers) and added to ``peak_device``, where the forward and backward run; allocator
fragmentation is not counted.

What a run writes to disk besides its NVMe swap files: ``checkpoint_bytes``, the whole
``save_checkpoint`` directory (every rank's file together: each trainable parameter's fp32
master and its optimizer state, (4 + S)Ψ, and the frozen parameters in the compute dtype,
PΨf; whatever the stage, since a checkpoint holds the training state, not the device's
copy), and ``export_bytes``, one ``save_pretrained`` of the model in the compute dtype,
P(Ψ + Ψf). They are what ``zero-strategy estimate --this-machine`` sets beside the disk's
free space.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._estimate_activations import _DTYPE_BYTES, ActivationEstimate, _count, estimate_activations
from ._estimate_machine import MachineFit, fit_on_this_machine
from ._estimate_working_set import UnitSizes, WorkingSetTerms, unit_sizes, working_set_terms
from .config import CPUOffload, NVMeOffload, ZeroConfig, ZeroConfigError, _as_dtype_name, _as_offload, _suggest

__all__ = ["MemoryEstimate", "estimate_memory", "format_table", "count_parameters", "OPTIMIZER_STATE_BYTES",
           "UnitSizes", "unit_sizes", "ActivationEstimate", "estimate_activations", "MachineFit",
           "fit_on_this_machine"]

# Optimizer-state bytes per parameter (fp32 state), excluding the master copy.
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8, "adamw": 8, "nadam": 8, "radam": 8, "adamax": 8,
    "sgd": 0, "sgd_momentum": 4, "adagrad": 4, "rmsprop": 4,
}
_DEFAULT_STAGING = NVMeOffload().buffer_count * NVMeOffload().buffer_size
_GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes held by one rank, by location, and the working set a step adds.

    ``offload_optimizer`` / ``offload_params`` are ``"none"``, ``"cpu"`` or ``"nvme"``.
    ``host_staging`` is pinned NVMe I/O buffers; ``nvme_bytes`` is on disk.
    ``working_set_*``: the categories of ``memory_report(...).peak_working_set`` (gathered
    units and gradient buckets on the device, staging in host memory), None where they
    cannot be known (no model given, or DDP). See [Note: the estimated working set].
    ``checkpoint_bytes`` / ``export_bytes``: the whole run's ``save_checkpoint`` directory and
    one ``save_pretrained`` (all ranks together, not per rank; see the module docstring).
    """

    stage: int
    world_size: int
    offload_optimizer: str
    offload_params: str
    precision: str
    num_params: int
    frozen_params: int
    device_params: int = 0
    device_grads: int = 0
    device_optimizer: int = 0
    host_params: int = 0
    host_grads: int = 0
    host_optimizer: int = 0
    host_staging: int = 0
    nvme_bytes: int = 0
    working_set_gathered: int | None = None
    working_set_grad_buckets: int | None = None
    working_set_staging: int | None = None
    activations: int = 0
    checkpoint_bytes: int = 0
    export_bytes: int = 0

    @property
    def total_device(self) -> int:
        return self.device_params + self.device_grads + self.device_optimizer

    @property
    def total_host(self) -> int:
        return self.host_params + self.host_grads + self.host_optimizer + self.host_staging

    @property
    def working_set_device(self) -> int | None:
        """Gathered units + gradient buckets at their peak (None: unknown without the model)."""
        if self.working_set_gathered is None or self.working_set_grad_buckets is None:
            return None
        return self.working_set_gathered + self.working_set_grad_buckets

    @property
    def working_set_host(self) -> int | None:
        return self.working_set_staging

    @property
    def peak_device(self) -> int | None:
        """Resting + working set (+ the activations given) on the device. Stage 1's buckets are its
        resting full gradients (``device_grads``): counted once."""
        if self.working_set_device is None:
            return None
        resting_buckets = self.device_grads if self.stage == 1 else 0
        return (self.total_device + self.working_set_gathered
                + max(0, self.working_set_grad_buckets - resting_buckets) + self.activations)

    @property
    def peak_host(self) -> int | None:
        """Resting + working set in host memory: the NVMe pool counted once, at the larger of
        ``host_staging`` and the working set's figure."""
        if self.working_set_staging is None:
            return None
        return self.total_host + max(0, self.working_set_staging - self.host_staging)

    @property
    def label(self) -> str:
        """Short name of the setup, e.g. ``"ZeRO-3 opt:cpu params:cpu"``."""
        name = "DDP" if self.stage == 0 else f"ZeRO-{self.stage}"
        if self.offload_optimizer != "none":
            name += f" opt:{self.offload_optimizer}"
        if self.offload_params != "none":
            name += f" params:{self.offload_params}"
        return name

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "label": self.label,
                "total_device": self.total_device, "total_host": self.total_host,
                "working_set_device": self.working_set_device, "working_set_host": self.working_set_host,
                "peak_device": self.peak_device, "peak_host": self.peak_host}

    def __str__(self) -> str:
        gib = lambda b: f"{b / _GIB:.2f} GiB"  # noqa: E731
        text = (f"{self.label}, {self.world_size} rank(s), {self.precision}: device {gib(self.total_device)} "
                f"(params {gib(self.device_params)}, grads {gib(self.device_grads)}, "
                f"optimizer {gib(self.device_optimizer)}), host {gib(self.total_host)}")
        text += f", nvme {gib(self.nvme_bytes)}" if self.nvme_bytes else ""
        if self.stage == 0:
            return text
        dev = "n/a (needs the model)" if self.peak_device is None else gib(self.peak_device)
        return (text + f"; peak with the working set: device {dev} (working set "
                f"{'n/a' if self.working_set_device is None else gib(self.working_set_device)}), "
                f"host {gib(self.peak_host)}")


_COLUMNS = (("setup", None), ("dev params", "device_params"), ("dev grads", "device_grads"),
            ("dev optim", "device_optimizer"), ("device", "total_device"), ("host", "total_host"),
            ("nvme", "nvme_bytes"), ("dev work", "working_set_device"), ("dev peak", "peak_device"),
            ("host peak", "peak_host"))


def format_table(estimates: MemoryEstimate | Sequence[MemoryEstimate]) -> str:
    """Aligned text table, sizes in GiB per rank."""
    if isinstance(estimates, MemoryEstimate):
        estimates = [estimates]
    rows = [[title if attr is None else f"{title} GiB" for title, attr in _COLUMNS]]
    for est in estimates:
        rows.append([est.label] + [_gib_cell(getattr(est, attr)) for _, attr in _COLUMNS[1:]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if estimates:
        e = estimates[0]
        lines.append(f"(model states per rank; {e.num_params:,} trainable + {e.frozen_params:,} frozen params, "
                     f"world size {e.world_size}, {e.precision}; activations not included)")
        lines.append("(dev work: stage-3 gathered units + gradient buckets at their peak; dev/host peak: resting + "
                     "working set, staging included"
                     + ("; n/a: needs the model's unit sizes (pass a model), or DDP" if any(
                         x.peak_device is None for x in estimates) else "") + ")")
    return "\n".join(lines)


def _gib_cell(value: int | None) -> str:
    return "n/a" if value is None else f"{value / _GIB:.2f}"


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, frozen) element counts; a tied parameter is counted once. Works on meta."""
    trainable = frozen = 0
    for param in model.parameters():  # deduplicates shared (tied) parameters
        if param.requires_grad:
            trainable += param.numel()
        else:
            frozen += param.numel()
    return trainable, frozen


def _optimizer_bytes(optimizer: str | int) -> int:
    if isinstance(optimizer, int) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise ZeroConfigError("optimizer", f"state bytes per parameter must be >= 0, got {optimizer}",
                                  "Pass e.g. 8 for Adam (two fp32 moments).")
        return optimizer
    key = str(optimizer).lower().replace("-", "_")
    if key not in OPTIMIZER_STATE_BYTES:
        hint = _suggest(key, OPTIMIZER_STATE_BYTES)
        raise ZeroConfigError("optimizer", f"unknown optimizer {optimizer!r}{hint}", "Known: "
                              + ", ".join(OPTIMIZER_STATE_BYTES) + "; or pass the state bytes per parameter as an int.")
    return OPTIMIZER_STATE_BYTES[key]


def _offload_name(policy: CPUOffload | NVMeOffload | None) -> str:
    return "none" if policy is None else policy.device


def _staging(policy: CPUOffload | NVMeOffload | None) -> int:
    return policy.buffer_count * policy.buffer_size if isinstance(policy, NVMeOffload) else 0


def _one(psi: int, psi_f: int, n: int, stage: int, p: int, g: int, k: int, precision: str,
         opt: CPUOffload | NVMeOffload | None, par: CPUOffload | NVMeOffload | None,
         one_memory: bool = False, units: UnitSizes | None = None, prefetch: int = 1,
         overlap_step: bool = False, state_bytes: int = 8) -> MemoryEstimate:
    """Apply the table in the module docstring to one (stage, offload) setup."""
    shard = lambda nbytes: math.ceil(nbytes / n)  # noqa: E731  (bytes of a 1/N share)
    if stage == 3:
        params = shard(p * psi) + shard(p * psi_f)
    else:
        params = p * psi + p * psi_f
    grads = shard(g * psi) if stage >= 2 else g * psi
    optim = shard(k * psi) if stage >= 1 else k * psi
    est = dict(device_params=params, device_grads=grads, device_optimizer=optim)
    if opt is not None:
        shares_params = isinstance(opt, CPUOffload) and (isinstance(par, CPUOffload) or one_memory)
        if p == 4 and not shares_params:
            optim = shard((k + 4) * psi)  # the host master is a copy of the device parameters
        est["device_optimizer"] = 0
        # the host copy keeps the reduce dtype; one memory: the step reads the shard itself
        est["host_grads"] = 0 if one_memory else shard(g * psi)
        if isinstance(opt, NVMeOffload):
            est["nvme_bytes"] = optim
            est["host_staging"] = _staging(opt)
        else:
            est["host_optimizer"] = optim
    if par is not None:
        est["device_params"] = 0
        if isinstance(par, NVMeOffload):
            est["nvme_bytes"] = est.get("nvme_bytes", 0) + params
            est["host_staging"] = est.get("host_staging", 0) + _staging(par)
        else:
            est["host_params"] = params
    ws: WorkingSetTerms | None = working_set_terms(
        units, stage=stage, world_size=n, psi=psi, psi_f=psi_f, p=p, g=g, opt=opt, par=par, prefetch=prefetch,
        overlap_step=overlap_step, one_memory=one_memory, state_bytes=state_bytes)
    if ws is not None:
        est.update(working_set_gathered=ws.gathered, working_set_grad_buckets=ws.grad_buckets,
                   working_set_staging=ws.staging)
    # the training state a checkpoint holds: fp32 masters + optimizer state, frozen in the compute dtype
    est.update(checkpoint_bytes=(4 + state_bytes) * psi + p * psi_f, export_bytes=p * (psi + psi_f))
    return MemoryEstimate(stage=stage, world_size=n, offload_optimizer=_offload_name(opt),
                          offload_params=_offload_name(par), precision=precision, num_params=psi,
                          frozen_params=psi_f, **est)


_SWEEP = ((0, None, None), (1, None, None), (2, None, None), (2, "cpu", None), (3, None, None),
          (3, "cpu", None), (3, "cpu", "cpu"), (3, "nvme", "nvme"))


def estimate_memory(
    model_or_num_params: torch.nn.Module | int | float,
    *,
    world_size: int = 1,
    stage: int | None = None,
    precision: str | torch.dtype | None = None,
    reduce_dtype: str | torch.dtype | None = None,
    optimizer: str | int = "adam",
    offload_optimizer: Any = None,
    offload_params: Any = None,
    frozen_params: int | float = 0,
    config: ZeroConfig | None = None,
    device: str = "cuda",
    shard_group_size: int | None = None,
    units: UnitSizes | None = None,
    activations: int = 0,
) -> MemoryEstimate | list[MemoryEstimate]:
    """Estimate per-rank model-state bytes and the working set (see the module docstring).

    Args:
        model_or_num_params: trainable parameter count, or an ``nn.Module`` (may be on
            the meta device) whose ``requires_grad`` parameters are trainable and the
            rest frozen (``frozen_params`` is then added to its frozen count).
        world_size: number of ranks N.
        stage: 0 (DDP reference), 1, 2 or 3; ``None`` returns a list covering DDP and
            each stage with the usual offload choices (or with the offload given).
        precision: compute dtype, default ``"bf16"``.
        reduce_dtype: gradient dtype, default = precision.
        optimizer: name (``"adam"``, ``"sgd"``, ...) or optimizer-state bytes per param.
        offload_optimizer: where the fp32 master and optimizer state rest: ``None``/``"none"``,
            ``"cpu"``, ``"nvme"`` or a :class:`CPUOffload` / :class:`NVMeOffload`.
        offload_params: where stage 3's parameter shards rest, the same choices.
        config: take stage, precision, reduce_dtype and offload from a ZeroConfig
            (then do not pass those arguments too).
        device: ``"cuda"`` (a GPU beside host memory, the default) or ``"cpu"`` (a
            CUDA-less machine: device and host share one memory, so fp32 offload keeps
            no second master or gradient copy).
        shard_group_size: hybrid sharding over groups of k of the N ranks: model states
            are sharded over k (the estimate is N=k's, reported with world_size k); an int
            dividing ``world_size``. Taken from ``config`` when it sets an int.
        units: the model's :func:`unit_sizes`, for the working set when only a parameter
            count is given (from a model it is read off the model, with ``config``'s
            ``unit_classes`` and ``param_persistence_threshold``). ``config`` also gives
            ``prefetch`` and ``overlap_step`` (default 1 and False).
        activations: activation bytes per rank to add to ``peak_device`` (see
            :func:`estimate_activations`: its ``peak_with_checkpointing`` or
            ``peak_without_checkpointing``, with ``tiled_loss`` as the config sets it).
    """
    if device not in ("cuda", "cpu"):
        raise ZeroConfigError("device", f"must be 'cuda' or 'cpu', got {device!r}",
                              "Pass device='cpu' for a CUDA-less machine, else leave it out.")
    one_memory = device == "cpu"
    if config is not None:
        if not isinstance(config, ZeroConfig):
            raise ZeroConfigError("config", f"expected a ZeroConfig, got {type(config).__name__}",
                                  "Pass ZeroConfig.load(...) or leave config out.")
        given = [name for name, value in (("stage", stage), ("precision", precision), ("reduce_dtype", reduce_dtype),
                                          ("offload_optimizer", offload_optimizer),
                                          ("offload_params", offload_params)) if value is not None]
        if given:
            raise ZeroConfigError("config", f"given together with {', '.join(given)}",
                                  "Pass either config or those arguments, or use config.replace(...).")
        stage, precision, reduce_dtype = config.stage, config.precision, config.reduce_dtype
        offload_optimizer, offload_params = config.offload_optimizer, config.offload_params
        if shard_group_size is None and isinstance(config.shard_group_size, int):
            shard_group_size = config.shard_group_size
    prefetch, overlap_step = (1, False) if config is None else (config.prefetch, config.overlap_step)
    if units is not None and not isinstance(units, UnitSizes):
        raise ZeroConfigError("units", f"expected a UnitSizes, got {type(units).__name__}",
                              "Pass zero_strategy.estimate.unit_sizes(model), or the model itself.")
    if isinstance(model_or_num_params, torch.nn.Module):
        if units is None:
            units = unit_sizes(model_or_num_params, () if config is None else config.unit_classes,
                               100_000 if config is None else config.param_persistence_threshold)
        psi, psi_f = count_parameters(model_or_num_params)
        psi_f += _count("frozen_params", frozen_params)
    else:
        psi = _count("model_or_num_params", model_or_num_params)
        psi_f = _count("frozen_params", frozen_params)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ZeroConfigError("world_size", f"must be an integer >= 1, got {world_size!r}",
                              "Pass the number of ranks, e.g. 8.")
    if shard_group_size is not None:  # hybrid: states are sharded over the group only
        if isinstance(shard_group_size, bool) or not isinstance(shard_group_size, int) or \
                shard_group_size < 1 or world_size % shard_group_size:
            raise ZeroConfigError("shard_group_size", f"must be an integer dividing world_size={world_size}, "
                                  f"got {shard_group_size!r}", "Pass the ranks per node, e.g. 8.")
        world_size = shard_group_size
    precision = _as_dtype_name("precision", "bf16" if precision is None else precision)
    grad_name = precision if reduce_dtype is None else _as_dtype_name("reduce_dtype", reduce_dtype)
    p, g = _DTYPE_BYTES[precision], _DTYPE_BYTES[grad_name]
    state_bytes = _optimizer_bytes(optimizer)
    k = (0 if precision == "fp32" else 4) + state_bytes
    opt = _as_offload("offload_optimizer", offload_optimizer)
    par = _as_offload("offload_params", offload_params)

    activations = _count("activations", activations)
    if activations:
        return _with_activations(_estimate(psi, psi_f, world_size, stage, p, g, k, precision, opt, par, one_memory,
                                           units, prefetch, overlap_step, state_bytes), activations)
    return _estimate(psi, psi_f, world_size, stage, p, g, k, precision, opt, par, one_memory, units, prefetch,
                     overlap_step, state_bytes)


def _with_activations(estimates, activations: int):
    if isinstance(estimates, list):
        return [dataclasses.replace(e, activations=activations) for e in estimates]
    return dataclasses.replace(estimates, activations=activations)


def _estimate(psi, psi_f, world_size, stage, p, g, k, precision, opt, par, one_memory, units, prefetch,
              overlap_step, state_bytes):
    """One setup, or the sweep over stages when ``stage`` is None."""
    if stage is None:
        if opt is None and par is None:
            setups = [(s, _as_offload("offload_optimizer", o), _as_offload("offload_params", q)) for s, o, q in _SWEEP]
        else:
            setups = [(0, None, None)] + [(s, opt, par) for s in (1, 2, 3) if par is None or s == 3]
        return [_one(psi, psi_f, world_size, s, p, g, k, precision, o, q, one_memory, units, prefetch, overlap_step,
                     state_bytes) for s, o, q in setups]
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ZeroConfigError("stage", f"must be 0 (DDP), 1, 2 or 3, got {stage!r}",
                              "Pass a stage, or stage=None for all of them.")
    if par is not None and stage != 3:
        raise ZeroConfigError("offload_params", f"needs stage 3, got stage {stage}",
                              "Pass stage=3, or drop offload_params.")
    if opt is not None and stage == 0:
        raise ZeroConfigError("offload_optimizer", "needs a ZeRO stage (1, 2 or 3), got stage 0 (DDP)",
                              "Pass stage=1, 2 or 3, or drop offload_optimizer.")
    return _one(psi, psi_f, world_size, stage, p, g, k, precision, opt, par, one_memory, units, prefetch,
                overlap_step, state_bytes)
