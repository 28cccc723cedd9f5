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
memory, or to NVMe with pinned staging buffers in host memory) and adds a 4Ψ/N fp32
gradient shard on the host for the CPU step. An offloaded fp32 master cannot share
storage with parameters on the device, so there M = 4 even for fp32 compute (only
fp32 stage 3 with both offloaded to host memory keeps M = 0: master and parameter
shard are then the same host tensor); offloading parameters (stage 3) moves
the (PΨ + PΨf)/N parameter shard. On a CUDA-less machine (``device="cpu"``) device
and host are one memory: an fp32 master is the parameter shard (M = 0) and fp32
gradients are stepped in place (no host gradient shard). Activations, temporary buffers, gathered stage-3
units and allocator fragmentation are *not* model states and are not counted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import CPUOffload, NVMeOffload, ZeroConfig, ZeroConfigError, _as_dtype_name, _as_offload, _suggest

__all__ = ["MemoryEstimate", "estimate_memory", "format_table", "count_parameters", "OPTIMIZER_STATE_BYTES"]

# Optimizer-state bytes per parameter (fp32 state), excluding the master copy.
OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adam": 8, "adamw": 8, "nadam": 8, "radam": 8, "adamax": 8,
    "sgd": 0, "sgd_momentum": 4, "adagrad": 4, "rmsprop": 4,
}
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_DEFAULT_STAGING = NVMeOffload().buffer_count * NVMeOffload().buffer_size
_GIB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Model-state bytes held by one rank, by location.

    ``offload_optimizer`` / ``offload_params`` are ``"none"``, ``"cpu"`` or ``"nvme"``.
    ``host_staging`` is pinned NVMe I/O buffers; ``nvme_bytes`` is on disk.
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

    @property
    def total_device(self) -> int:
        return self.device_params + self.device_grads + self.device_optimizer

    @property
    def total_host(self) -> int:
        return self.host_params + self.host_grads + self.host_optimizer + self.host_staging

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
                "total_device": self.total_device, "total_host": self.total_host}

    def __str__(self) -> str:
        gib = lambda b: f"{b / _GIB:.2f} GiB"  # noqa: E731
        text = (f"{self.label}, {self.world_size} rank(s), {self.precision}: device {gib(self.total_device)} "
                f"(params {gib(self.device_params)}, grads {gib(self.device_grads)}, "
                f"optimizer {gib(self.device_optimizer)}), host {gib(self.total_host)}")
        return text + (f", nvme {gib(self.nvme_bytes)}" if self.nvme_bytes else "")


_COLUMNS = (("setup", None), ("dev params", "device_params"), ("dev grads", "device_grads"),
            ("dev optim", "device_optimizer"), ("device", "total_device"), ("host", "total_host"),
            ("nvme", "nvme_bytes"))


def format_table(estimates: MemoryEstimate | Sequence[MemoryEstimate]) -> str:
    """Aligned text table, sizes in GiB per rank."""
    if isinstance(estimates, MemoryEstimate):
        estimates = [estimates]
    rows = [[title if attr is None else f"{title} GiB" for title, attr in _COLUMNS]]
    for est in estimates:
        rows.append([est.label] + [f"{getattr(est, attr) / _GIB:.2f}" for _, attr in _COLUMNS[1:]])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if estimates:
        e = estimates[0]
        lines.append(f"(model states per rank; {e.num_params:,} trainable + {e.frozen_params:,} frozen params, "
                     f"world size {e.world_size}, {e.precision}; activations not included)")
    return "\n".join(lines)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, frozen) element counts; a tied parameter is counted once. Works on meta."""
    trainable = frozen = 0
    for param in model.parameters():  # deduplicates shared (tied) parameters
        if param.requires_grad:
            trainable += param.numel()
        else:
            frozen += param.numel()
    return trainable, frozen


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ZeroConfigError(name, f"expected a non-negative number of parameters, got {value!r}",
                              "Pass e.g. 7e9 or an nn.Module.")
    return int(round(value))


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
         one_memory: bool = False) -> MemoryEstimate:
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
        est["host_grads"] = 0 if (one_memory and g == 4) else shard(4 * psi)
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
) -> MemoryEstimate | list[MemoryEstimate]:
    """Estimate per-rank model-state bytes (see the module docstring for the formulas).

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
        offload_optimizer, offload_params: ``None``/``"none"``, ``"cpu"``, ``"nvme"``
            or a :class:`CPUOffload` / :class:`NVMeOffload`.
        config: take stage, precision, reduce_dtype and offload from a ZeroConfig
            (then do not pass those arguments too).
        device: ``"cuda"`` (a GPU beside host memory, the default) or ``"cpu"`` (a
            CUDA-less machine: device and host share one memory, so fp32 offload keeps
            no second master or gradient copy).
        shard_group_size: hybrid sharding over groups of k of the N ranks: model states
            are sharded over k (the estimate is N=k's, reported with world_size k); an int
            dividing ``world_size``. Taken from ``config`` when it sets an int.
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
    if isinstance(model_or_num_params, torch.nn.Module):
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
    k = (0 if precision == "fp32" else 4) + _optimizer_bytes(optimizer)
    opt = _as_offload("offload_optimizer", offload_optimizer)
    par = _as_offload("offload_params", offload_params)

    if stage is None:
        if opt is None and par is None:
            setups = [(s, _as_offload("offload_optimizer", o), _as_offload("offload_params", q)) for s, o, q in _SWEEP]
        else:
            setups = [(0, None, None)] + [(s, opt, par) for s in (1, 2, 3) if par is None or s == 3]
        return [_one(psi, psi_f, world_size, s, p, g, k, precision, o, q, one_memory) for s, o, q in setups]
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ZeroConfigError("stage", f"must be 0 (DDP), 1, 2 or 3, got {stage!r}",
                              "Pass a stage, or stage=None for all of them.")
    if par is not None and stage != 3:
        raise ZeroConfigError("offload_params", f"needs stage 3, got stage {stage}",
                              "Pass stage=3, or drop offload_params.")
    if opt is not None and stage == 0:
        raise ZeroConfigError("offload_optimizer", "needs a ZeRO stage (1, 2 or 3), got stage 0 (DDP)",
                              "Pass stage=1, 2 or 3, or drop offload_optimizer.")
    return _one(psi, psi_f, world_size, stage, p, g, k, precision, opt, par, one_memory)


@dataclass(frozen=True)
class UnitSizes:
    """Parameter elements of the stage-3 units of a model (see [Note: choosing units] in _engine/units.py).

    ``root``: elements outside every unit (embeddings, final norm, head), gathered from the
    start of forward to the end of backward; ``largest``: the largest unit; ``count``: units.
    """

    root: int
    largest: int
    count: int

    def live_bytes(self, param_bytes: int, grad_bytes: int, prefetch: int = 1) -> int:
        """Stage-3 parameters materialised at the peak, beyond the shards: the root, the unit
        in use and ``prefetch`` units gathered ahead (compute dtype), and the full gradient
        of one unit before its reduce-scatter (gradient dtype)."""
        return param_bytes * (self.root + (1 + prefetch) * self.largest) + grad_bytes * self.largest


def unit_sizes(model: torch.nn.Module, unit_classes: Sequence[str] = ()) -> UnitSizes:
    """Units as setup would choose them; reads only ``numel`` (works on the meta device)."""
    from ._units import find_unit_modules

    units = find_unit_modules(model, tuple(unit_classes))
    seen: set[int] = set()
    sizes = []
    for _, module in units:
        n = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        sizes.append(n)
    total = sum(p.numel() for p in model.parameters())
    return UnitSizes(root=total - sum(sizes), largest=max(sizes, default=0), count=len(sizes))


# ------------------------------------------------------------------ activations
#
# [Note: activation memory of a Llama-style decoder]
# Activation memory is what autograd saves for backward: the tensors the forward's
# operations keep (``torch.autograd.graph.saved_tensors_hooks`` sees each one), counted
# once per storage. Korthikanti et al. ("Reducing Activation Recomputation in Large
# Transformer Models", 2022, §4.1) count sbh(34 + 5as/h) bytes per GPT layer in 16-bit
# with dropout (s tokens, b sequences, h hidden, a heads). A Hugging Face Llama-style
# layer (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP of width f, no
# dropout) saves, with e the bytes of the compute dtype (bf16 2, fp32 4):
#
#   each RMSNorm (two per layer): the input upcast to fp32 (4sbh; in fp32 the input
#     itself), the normalised tensor cast back (e·sbh, kept by ``weight * x``), its output
#     (e·sbh, kept by the next projections) and rsqrt of the variance (4sb, fp32):
#     (4 + 2e)sbh + 4sb;
#   attention: the rotary q (e·sbh) and, repeated to all heads, k and v (2e·sbh; the rotary
#     multiplications keep only cos/sin, which need no gradient), the output before o_proj
#     (e·sbh); with eager attention also the fp32 softmax (4·as²b) and its cast for the
#     product with v (e·as²b, bf16 only): 4e·sbh + (4 + e')as²b, e' = e below 4 bytes else 0;
#     with SDPA (PyTorch's fused kernel, the HF default) q, k and v at their own head
#     counts (kv heads g: (1 + 2g/a)e·sbh), the output (e·sbh, also o_proj's input) and
#     the fp32 log-sum-exp (4·asb) instead of any s² term;
#   SwiGLU MLP: gate output (kept by SiLU), SiLU output, up output (both kept by the
#     product) and the product (kept by down_proj): 4e·sbf.
#
# Per layer, eager:  sbh(8 + 8e + 4e·f/h) + 8sb + (4 + e')as²b
#            SDPA:   sbh(8 + 6e + 2e·g/a + 4e·f/h) + 8sb + 4asb
# Outside the layers: token ids (8bs, int64), the rotary cos/sin tables (2e·s·h/a: one
# for the batch), the final RMSNorm ((4 + 2e)sbh + 4sb) and the loss: the fp32
# log-softmax of the logits (4bsV), the labels padded by one (8b(s + 1); for b > 1 the
# shifted copy holds 8bs, 8b bytes less) and the loss's fp32 weight sum (4). In bf16 with eager attention and f = 8h/3
# (Llama 2 shape) a layer keeps sbh(45.3 + 6as/h) bytes against GPT's 34 + 5as/h: the
# fp32 upcasts of RMSNorm and softmax and the wider gated MLP cost more than the
# dropout masks they lack. With gradient checkpointing (one checkpoint per layer, as
# ``gradient_checkpointing_enable`` sets) each layer keeps only its input (e·sbh) until
# backward recomputes it, so the peak is L·e·sbh + the outside + one layer's activations.
# test_estimate_activations.py checks both against saved-tensor bytes measured on CPU.


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes autograd keeps for backward in one forward of ``batch_size`` x ``seq_len`` tokens
    per rank. See [Note: activation memory of a Llama-style decoder]."""

    batch_size: int
    seq_len: int
    layers: int
    precision: str
    attention: str
    per_layer: int      # one decoder layer, no checkpointing
    layer_input: int    # what a checkpointed layer keeps: its input
    outside: int        # token ids, rotary tables, final norm, loss
    rotary: int         # the rotary cos/sin tables (part of ``outside``)

    @property
    def without_checkpointing(self) -> int:
        return self.layers * self.per_layer + self.outside

    @property
    def with_checkpointing(self) -> int:
        """Peak with one checkpoint per layer: every layer's input, plus one layer recomputed."""
        return self.layers * self.layer_input + self.outside + self.per_layer

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "without_checkpointing": self.without_checkpointing,
                "with_checkpointing": self.with_checkpointing}


_LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "granite")


def estimate_activations(hf_config: Any, batch_size: int, seq_len: int, precision: str = "bf16",
                         attention: str | None = None) -> ActivationEstimate:
    """Activation bytes per rank of a Llama-style Hugging Face decoder (``hf_config``: its config).

    ``attention``: ``"eager"`` or ``"sdpa"``; default: the config's ``attn_implementation``
    (``"sdpa"`` when unset, as transformers chooses). Assumes training with
    ``use_cache=False`` (a KV cache would hold k and v of every layer besides).
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _LLAMA_STYLE:
        raise ZeroConfigError("--batch-size", f"the activation formula covers Llama-style decoders "
                              f"({', '.join(_LLAMA_STYLE)}), not model_type {model_type!r}",
                              "Leave out --batch-size/--seq-len for this model (model states only).")
    b, s = _count("batch_size", batch_size), _count("seq_len", seq_len)
    e = _DTYPE_BYTES[_as_dtype_name("precision", precision)]
    h, f, v = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size
    a = hf_config.num_attention_heads
    g = getattr(hf_config, "num_key_value_heads", None) or a
    layers = hf_config.num_hidden_layers
    attention = attention or getattr(hf_config, "_attn_implementation", None) or "sdpa"
    if attention not in ("eager", "sdpa"):
        raise ZeroConfigError("--attention", f"the formula covers eager and sdpa attention, not {attention!r}",
                              "Pass --attention eager or sdpa (flash-attention saves what sdpa does).")
    sbh, sb = s * b * h, s * b
    norm = (4 + 2 * e) * sbh + 4 * sb
    mlp = 4 * e * s * b * f
    if attention == "eager":
        attn = 4 * e * sbh + (4 + (e if e < 4 else 0)) * a * s * s * b
    else:
        attn = (1 + 2 * g / a) * e * sbh + e * sbh + 4 * a * s * b
    rotary = 2 * e * s * (h // a)  # one table for the batch: position ids are (1, s)
    outside = 8 * b * s + rotary + norm + 4 * b * s * v + 8 * b * (s + 1) + 4
    return ActivationEstimate(batch_size=b, seq_len=s, layers=layers, precision=precision, attention=attention,
                              per_layer=int(2 * norm + attn + mlp), layer_input=e * sbh, outside=outside,
                              rotary=rotary)
