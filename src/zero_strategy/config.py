"""Public configuration of the ZeRO engine: typed, frozen, validated once.

Layer 1 of the design (see DESIGN.md §2): everything a user can set lives here as
frozen dataclasses, and nothing below this layer re-validates. A config comes from

* keyword arguments: ``ZeroConfig(stage=2, offload_optimizer="cpu")``;
* a preset: ``ZeroConfig.preset("zero3_offload", gradient_clipping=1.0)``;
* a mapping, YAML or JSON file: ``ZeroConfig.from_dict({...})`` / ``from_file(path)``;
* a DeepSpeed ``ds_config`` (its ZeRO, fp16/bf16 and clipping parts):
  ``ZeroConfig.from_deepspeed(path_or_dict)`` (mapping table in
  :mod:`zero_strategy._config.deepspeed`);
* any of the above: ``ZeroConfig.load(spec)``.

[Note: one error type]
Every problem raises :class:`ZeroConfigError` (a ``ValueError``) whose message names
the key (as a dotted path such as ``loss_scale.growth_interval``), the bad value and
the fix; unknown keys come with difflib "did you mean" suggestions. Front ends can
catch one type and show the message as is.

[Note: normalisation]
Convenient spellings (``"cpu"`` for ``CPUOffload()``, ``"bfloat16"`` or
``torch.bfloat16`` for ``"bf16"``, a single class name for ``unit_classes``) are
normalised in ``__post_init__``, so the engine only ever sees canonical values and
``ZeroConfig.from_dict(cfg.to_dict()) == cfg`` holds.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import torch

from ._config_values import (  # ZeroConfigError is public here too
    _DTYPES,
    ZeroConfigError,
    _as_bool,
    _as_dtype_name,
    _as_float,
    _as_generation_offload,
    _as_int,
    _as_unit_classes,
    _check_keys,
    _suggest,
    FILE_SUFFIXES,
    looks_like_deepspeed,
    read_mapping_file,
)

__all__ = [
    "ZeroConfigError",
    "CPUOffload",
    "NVMeOffload",
    "LossScaleConfig",
    "ZeroConfig",
    "PRESETS",
    "preset_names",
    "OffloadPolicy",
]



# ------------------------------------------------------------------ offload policies


@dataclass(frozen=True)
class CPUOffload:
    """Offloaded state lives in host memory (pinned by default for fast, async copies)."""

    pin_memory: bool = True

    def __post_init__(self) -> None:
        _as_bool("pin_memory", self.pin_memory)

    device = "cpu"


#: bounds of NVMeOffload.buffer_count / buffer_size (see the messages in __post_init__)
MAX_BUFFER_COUNT = 1024
MAX_BUFFER_SIZE = 1 << 30


@dataclass(frozen=True)
class NVMeOffload:
    """Offloaded state lives in files under ``path``, streamed through pinned buffers.

    ``path=None`` is resolved by the engine: ``$ZERO_STRATEGY_NVME_PATH``, else a
    temporary directory. ``buffer_size`` is in bytes and a multiple of 4096 so
    buffers can be used for O_DIRECT I/O.
    """

    path: str | None = None
    buffer_count: int = 4
    buffer_size: int = 64 * 2**20
    io_threads: int = 4
    read_ahead: int = 1
    pin_memory: bool = True

    def __post_init__(self) -> None:
        if self.path is not None:
            if isinstance(self.path, os.PathLike):
                object.__setattr__(self, "path", os.fspath(self.path))
            elif not isinstance(self.path, str) or not self.path:
                raise ZeroConfigError("path", f"expected a directory path or null, got {self.path!r}",
                                      "Give a directory on a fast local disk, or null to use "
                                      "$ZERO_STRATEGY_NVME_PATH or a temp dir.")
        object.__setattr__(self, "buffer_count", _as_int(
            "buffer_count", self.buffer_count, 2, MAX_BUFFER_COUNT,
            "each buffer is a host staging slot as large as one group's swapped state, and the pipeline "
            "never has more than read_ahead + 4 (plus stage 3's prefetch) in use, so more only hold memory"))
        size = _as_int("buffer_size", self.buffer_size, 1, MAX_BUFFER_SIZE,
                       "it is the size of one read or write request, and Linux moves at most 2 GiB - 4 KiB "
                       "per request")
        if size % 4096:
            up = -(-size // 4096) * 4096
            raise ZeroConfigError("buffer_size", f"must be a multiple of 4096 bytes, got {size}",
                                  f"Use {up} (the next multiple of 4096).")
        object.__setattr__(self, "buffer_size", size)
        object.__setattr__(self, "io_threads", _as_int("io_threads", self.io_threads, 1, 256,
                                                       "more threads than that only queue on the disk"))
        object.__setattr__(self, "read_ahead", _as_int(
            "read_ahead", self.read_ahead, 0, MAX_BUFFER_COUNT - 4,
            "every group read ahead holds one staging buffer (see buffer_count)"))
        _as_bool("pin_memory", self.pin_memory)

    device = "nvme"


OffloadPolicy = Union[None, CPUOffload, NVMeOffload]
_OFFLOAD_CLASSES = {"cpu": CPUOffload, "nvme": NVMeOffload}


def _as_offload(key: str, value: Any) -> OffloadPolicy:
    """Normalise None / "none" / "cpu" / "nvme" / {"device": ..., ...} / a policy."""
    if value is None or isinstance(value, (CPUOffload, NVMeOffload)):
        return value
    if isinstance(value, str):
        name = value.lower()
        if name == "none":
            return None
        if name in _OFFLOAD_CLASSES:
            return _OFFLOAD_CLASSES[name]()
        hint = _suggest(name, ["none", "cpu", "nvme"])
        raise ZeroConfigError(key, f"unknown offload device {value!r}{hint}", 'Use "none", "cpu" or "nvme".')
    if isinstance(value, Mapping):
        options = dict(value)
        device = str(options.pop("device", "cpu")).lower()
        if device == "none":
            if options:
                raise ZeroConfigError(key, f"device 'none' takes no options, got {sorted(options)}",
                                      'Drop the options or set device to "cpu" or "nvme".')
            return None
        if device not in _OFFLOAD_CLASSES:
            hint = _suggest(device, ["none", "cpu", "nvme"])
            raise ZeroConfigError(f"{key}.device", f"unknown offload device {device!r}{hint}",
                                  'Use "none", "cpu" or "nvme".')
        cls = _OFFLOAD_CLASSES[device]
        _check_keys(options, ["device"] + [f.name for f in dataclasses.fields(cls)], key, "option")
        try:
            return cls(**options)
        except ZeroConfigError as err:
            raise err.within(key) from None
    raise ZeroConfigError(key, f"expected \"none\", \"cpu\", \"nvme\", a mapping or an offload policy, got {value!r}",
                          "Write e.g. offload_optimizer: cpu, or {device: nvme, path: /local_nvme}.")


def _offload_to_dict(policy: OffloadPolicy) -> dict | None:
    if policy is None:
        return None
    return {"device": policy.device, **dataclasses.asdict(policy)}


# ------------------------------------------------------------------ loss scaling


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 dynamic loss scaling (ignored for fp32 and bf16).

    The scale starts at ``initial_scale``; after ``growth_interval`` steps without an
    overflow it is multiplied by ``growth_factor``; each overflowing step is skipped,
    and after ``hysteresis`` overflows (DeepSpeed's meaning) the scale is multiplied
    by ``backoff_factor``, never going below ``min_scale``. ``static=True`` keeps
    ``initial_scale`` for the whole run (overflowing steps are still skipped).
    """

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 1
    min_scale: float = 1.0
    static: bool = False

    def __post_init__(self) -> None:
        for name in ("initial_scale", "min_scale"):
            value = _as_float(name, getattr(self, name))
            if value <= 0:
                raise ZeroConfigError(name, f"must be > 0, got {value}", "Use a positive scale such as 65536.")
            object.__setattr__(self, name, value)
        growth = _as_float("growth_factor", self.growth_factor)
        if growth <= 1:
            raise ZeroConfigError("growth_factor", f"must be > 1, got {growth}", "Use e.g. 2.0.")
        backoff = _as_float("backoff_factor", self.backoff_factor)
        if not 0 < backoff < 1:
            raise ZeroConfigError("backoff_factor", f"must be in (0, 1), got {backoff}", "Use e.g. 0.5.")
        object.__setattr__(self, "growth_factor", growth)
        object.__setattr__(self, "backoff_factor", backoff)
        object.__setattr__(self, "growth_interval", _as_int("growth_interval", self.growth_interval, 1))
        object.__setattr__(self, "hysteresis", _as_int("hysteresis", self.hysteresis, 1))
        _as_bool("static", self.static)
        if self.min_scale > self.initial_scale:
            raise ZeroConfigError("min_scale", f"{self.min_scale} is above initial_scale {self.initial_scale}",
                                  "Lower min_scale or raise initial_scale.")


def _as_loss_scale(value: Any) -> LossScaleConfig:
    if isinstance(value, LossScaleConfig):
        return value
    if isinstance(value, Mapping):
        _check_keys(value, [f.name for f in dataclasses.fields(LossScaleConfig)], "loss_scale")
        try:
            return LossScaleConfig(**value)
        except ZeroConfigError as err:
            raise err.within("loss_scale") from None
    raise ZeroConfigError("loss_scale", f"expected a mapping or LossScaleConfig, got {value!r}",
                          "Write e.g. loss_scale: {initial_scale: 65536, growth_interval: 1000}.")


# ------------------------------------------------------------------ the config


@dataclass(frozen=True)
class ZeroConfig:
    """What to shard, where offloaded state lives, and the numerics of the step.

    Attributes:
        stage: 1 shards optimizer state, 2 also gradients, 3 also parameters.
        offload_optimizer: where the fp32 master shard and optimizer state live and
            the step runs: ``None`` (device), :class:`CPUOffload`, :class:`NVMeOffload`.
        offload_params: stage 3 only: where parameter shards rest between uses.
        precision: compute/parameter dtype, ``"fp32"``, ``"bf16"`` or ``"fp16"``;
            master weights are always fp32.
        reduce_dtype: dtype gradients are reduced and kept in; ``None`` = precision.
        gradient_clipping: global-norm clip applied in ``optimizer.step()``;
            ``None`` or ``0`` disables it.
        loss_scale: fp16 dynamic loss scaling (ignored for fp32/bf16).
        unit_classes: module class names that become units; ``()`` auto-detects the
            blocks held in ``nn.ModuleList`` containers and the repeated composite
            blocks of ``nn.Sequential`` / ``nn.ModuleDict`` (see ``[Note: choosing units]``
            in _engine/units.py).
        param_persistence_threshold: stage 3: parameters with fewer elements stay
            whole on every rank (not worth a collective).
        prefetch: stage 3: how many units are gathered ahead of use.
        cast_forward_inputs: cast floating-point inputs of the root forward to the
            compute dtype.
        overlap_step: CPU/NVMe optimizer offload, stages 2-3: step each group on the CPU
            as soon as its gradients are reduced, while backward goes on. It declares
            that every backward outside ``no_sync()`` ends an accumulation and is followed
            by ``optimizer.step()``; it cannot combine with clipping or fp16, which need
            every gradient before the first update.
        collective_timeout: seconds a rank waits on any collective of the engine (gathers,
            reduce-scatters, the overflow and gradient-norm all-reduces, broadcasts,
            checkpoint agreement) before it raises :class:`~zero_strategy.CollectiveTimeout`
            naming the collective, the step, the ranks that never began the call or failed,
            and the last collectives of each rank (a peer stuck or hung, a forward,
            ``generate()`` or ``state_dict()`` run on some ranks only, a desync); a peer
            that exits or is killed is noticed at once (:class:`~zero_strategy.CollectiveError`).
            ``None`` leaves it to the process group's timeout (30 minutes by default). Raise
            it when a rank is legitimately that much slower than the others to reach a
            collective (a long rank-0-only evaluation or save between steps).
        shard_group_size: hybrid sharding: shard over groups of this many consecutive ranks
            and replicate across the groups (``"node"``: ``LOCAL_WORLD_SIZE``); gradients are
            reduce-scattered in the group and all-reduced across groups. ``None``: shard over
            all ranks. See [Note: hybrid sharding] in _comm/hybrid.py.
        auto: the ``zero_auto`` preset: at setup, when the model is known, stage and
            offload are replaced by the least-offloaded preset whose model states fit the
            memory measured on this machine (see :mod:`zero_strategy._zero_auto`); the other
            fields are kept. Until then ``stage`` is 3 (a model built under a front end's
            stage-3 meta-device context is counted without being materialised).
        offload_states_during_generation: what the trainer integrations move off the compute
            device while the policy generates (online RL: GRPO and kin), with
            :func:`~zero_strategy.offload_states` / ``reload_states`` around each generation:
            ``False`` (nothing), ``True`` (everything only training needs: optimizer state,
            masters, gradients), or a list of kinds (DeepSpeed's ``OffloadStateTypeEnum``
            names or ours). The parameters cannot be among them: generation runs the model.
            Stored as the tuple of kinds (empty: off).
    """

    stage: int = 3
    offload_optimizer: OffloadPolicy = None
    offload_params: OffloadPolicy = None
    precision: str = "fp32"
    reduce_dtype: str | None = None
    gradient_clipping: float | None = None
    loss_scale: LossScaleConfig = LossScaleConfig()
    unit_classes: tuple[str, ...] = ()
    param_persistence_threshold: int = 100_000
    prefetch: int = 1
    cast_forward_inputs: bool = True
    overlap_step: bool = False
    collective_timeout: float | None = 300.0
    auto: bool = False
    shard_group_size: int | str | None = None
    offload_states_during_generation: bool | tuple[str, ...] = ()

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        stage = _as_int("stage", self.stage)
        if stage == 0:
            raise ZeroConfigError("stage", "stage 0 is plain data parallel (no sharding)",
                                  "Use torch DistributedDataParallel, or stage 1 to shard optimizer state.")
        if stage not in (1, 2, 3):
            raise ZeroConfigError("stage", f"must be 1, 2 or 3, got {stage}",
                                  "1 shards optimizer state, 2 also gradients, 3 also parameters.")
        set_("stage", stage)
        set_("offload_optimizer", _as_offload("offload_optimizer", self.offload_optimizer))
        set_("offload_params", _as_offload("offload_params", self.offload_params))
        if self.offload_params is not None and stage != 3:
            raise ZeroConfigError("offload_params", f"needs stage 3 (parameters are only sharded there), "
                                  f"got stage {stage}", "Set stage: 3, or drop offload_params.")
        set_("precision", _as_dtype_name("precision", self.precision))
        if self.reduce_dtype is not None:
            set_("reduce_dtype", _as_dtype_name("reduce_dtype", self.reduce_dtype))
        if self.gradient_clipping is not None:
            clip = _as_float("gradient_clipping", self.gradient_clipping)
            if clip < 0:
                raise ZeroConfigError("gradient_clipping", f"must be >= 0, got {clip}",
                                      "Use a positive max norm such as 1.0, or null / 0 to disable clipping.")
            set_("gradient_clipping", clip)
        set_("loss_scale", _as_loss_scale(self.loss_scale))
        set_("unit_classes", _as_unit_classes(self.unit_classes))
        set_("param_persistence_threshold",
             _as_int("param_persistence_threshold", self.param_persistence_threshold, 0))
        set_("prefetch", _as_int("prefetch", self.prefetch, 0))
        _as_bool("cast_forward_inputs", self.cast_forward_inputs)
        if _as_bool("overlap_step", self.overlap_step):
            if self.offload_optimizer is None or stage == 1:
                raise ZeroConfigError("overlap_step", "needs optimizer offload at stage 2 or 3 (the step "
                                      "overlaps backward on the CPU)",
                                      "Set offload_optimizer: cpu and stage: 2 or 3, or drop overlap_step.")
            if self.gradient_clipping or self.precision == "fp16":
                raise ZeroConfigError("overlap_step", "cannot combine with gradient_clipping or fp16: both "
                                      "need every gradient before the first group may step",
                                      "Drop overlap_step, or use bf16/fp32 without clipping.")
        if _as_bool("auto", self.auto) and (self.offload_optimizer is not None or self.offload_params is not None):
            raise ZeroConfigError("auto", "zero_auto chooses the offload itself; an offload was given too",
                                  "Drop offload_optimizer/offload_params, or name a preset instead of zero_auto.")
        if self.auto and self.shard_group_size is not None:
            raise ZeroConfigError("shard_group_size", "zero_auto does not plan hybrid sharding yet (each shard "
                                  "group would measure and choose on its own)",
                                  "Name a preset (e.g. zero3) with shard_group_size, or drop shard_group_size.")
        if self.shard_group_size is not None and self.shard_group_size != "node":
            size = _as_int("shard_group_size", self.shard_group_size, 1)
            set_("shard_group_size", size)
        set_("offload_states_during_generation",
             _as_generation_offload(self.offload_states_during_generation))
        if self.collective_timeout is not None:
            timeout = _as_float("collective_timeout", self.collective_timeout)
            if not timeout > 0 or timeout == float("inf"):
                raise ZeroConfigError("collective_timeout", f"must be a positive number of seconds, got {timeout}",
                                      "Use e.g. 300, or null to rely on the process group's own timeout.")
            set_("collective_timeout", timeout)

    # -- derived values --------------------------------------------------------

    @property
    def compute_dtype(self) -> torch.dtype:
        """dtype of parameters in forward/backward."""
        return _DTYPES[self.precision]

    @property
    def gradient_reduce_dtype(self) -> torch.dtype:
        """dtype gradients are reduced and kept in: ``reduce_dtype`` or the compute dtype."""
        return _DTYPES[self.reduce_dtype or self.precision]

    # -- construction ----------------------------------------------------------

    def replace(self, **changes: Any) -> ZeroConfig:
        """A copy with ``changes`` applied and validated (unknown names raise)."""
        _check_keys(changes, _FIELD_NAMES, None, "field")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """A plain, JSON-able dict that :meth:`from_dict` reads back to an equal config."""
        return {
            "stage": self.stage,
            "offload_optimizer": _offload_to_dict(self.offload_optimizer),
            "offload_params": _offload_to_dict(self.offload_params),
            "precision": self.precision,
            "reduce_dtype": self.reduce_dtype,
            "gradient_clipping": self.gradient_clipping,
            "loss_scale": dataclasses.asdict(self.loss_scale),
            "unit_classes": list(self.unit_classes),
            "param_persistence_threshold": self.param_persistence_threshold,
            "prefetch": self.prefetch,
            "cast_forward_inputs": self.cast_forward_inputs,
            "overlap_step": self.overlap_step,
            "collective_timeout": self.collective_timeout,
            "shard_group_size": self.shard_group_size,
            **({"auto": True} if self.auto else {}),
            **({"offload_states_during_generation": list(self.offload_states_during_generation)}
               if self.offload_states_during_generation else {}),
        }

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ZeroConfig:
        """A named preset (see :data:`PRESETS`) with ``overrides`` applied."""
        key = _preset_key(name)
        _check_keys(overrides, _FIELD_NAMES, None, "field")
        return cls(**{**PRESETS[key][1], **overrides})

    @classmethod
    def from_dict(cls, d: Mapping) -> ZeroConfig:
        """Build from a mapping of field names; nested sections may be mappings.

        An optional ``"preset"`` key names the base the other keys override.
        Offload sections are ``"none"``/``"cpu"``/``"nvme"`` or
        ``{"device": "nvme", "path": ..., "buffer_count": ...}``.
        """
        if not isinstance(d, Mapping):
            raise ZeroConfigError(None, f"a ZeRO config must be a mapping, got {type(d).__name__}",
                                  "Write key: value pairs such as {stage: 3}.")
        d = dict(d)
        _check_keys(d, ["preset", *_FIELD_NAMES], None)
        base: dict[str, Any] = {}
        if "preset" in d:
            base = dict(PRESETS[_preset_key(d.pop("preset"), "preset")][1])
        return cls(**{**base, **d})

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ZeroConfig:
        """Read a ``.yaml``/``.yml``/``.json`` file (ours, or a DeepSpeed ``ds_config``)."""
        data = read_mapping_file(Path(path))
        try:
            if looks_like_deepspeed(data):
                return cls.from_deepspeed(data)
            return cls.from_dict(data)
        except ZeroConfigError as err:
            raise err.from_source(str(path)) from None

    @classmethod
    def from_deepspeed(cls, path_or_dict: str | os.PathLike | Mapping) -> ZeroConfig:
        """Translate a DeepSpeed ``ds_config`` (see :mod:`zero_strategy._config.deepspeed`)."""
        from ._deepspeed_config import translate_deepspeed

        if isinstance(path_or_dict, Mapping):
            return cls(**translate_deepspeed(path_or_dict).fields)
        source = str(path_or_dict)
        data = read_mapping_file(Path(path_or_dict))
        try:
            return cls(**translate_deepspeed(data).fields)
        except ZeroConfigError as err:
            raise err.from_source(source) from None

    @classmethod
    def load(cls, spec: Any) -> ZeroConfig:
        """Accept whatever a user may hand a front end.

        ``spec`` is a :class:`ZeroConfig`, a preset name, a path to a YAML/JSON file,
        or a mapping (ours, or a DeepSpeed ``ds_config``).
        """
        if isinstance(spec, ZeroConfig):
            return spec
        if isinstance(spec, Mapping):
            return cls.from_deepspeed(spec) if looks_like_deepspeed(spec) else cls.from_dict(spec)
        if isinstance(spec, (str, os.PathLike)):
            text = os.fspath(spec)
            if isinstance(spec, str) and _preset_key_or_none(text) is not None:
                return cls.preset(text)
            if Path(text).suffix.lower() in FILE_SUFFIXES or Path(text).exists():
                return cls.from_file(text)
            hint = _suggest(text.lower(), PRESETS)
            raise ZeroConfigError(None, f"{text!r} is neither a preset name nor an existing config file{hint}",
                                  "Presets: " + ", ".join(PRESETS) + "; files: .yaml, .yml, .json.")
        raise ZeroConfigError(None, f"cannot build a ZeRO config from {type(spec).__name__} {spec!r}",
                              "Pass a ZeroConfig, a preset name, a path to a .yaml/.json file, or a mapping.")


_FIELD_NAMES = [f.name for f in dataclasses.fields(ZeroConfig)]


# ------------------------------------------------------------------ presets

PRESETS: dict[str, tuple[str, dict]] = {
    "zero1": ("stage 1: shard optimizer state", {"stage": 1}),
    "zero2": ("stage 2: shard optimizer state and gradients", {"stage": 2}),
    "zero2_offload": ("stage 2, optimizer state and step on the CPU",
                      {"stage": 2, "offload_optimizer": "cpu"}),
    "zero3": ("stage 3: shard optimizer state, gradients and parameters", {"stage": 3}),
    "zero3_offload": ("stage 3, optimizer state and parameter shards in CPU memory",
                      {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}),
    "zero3_offload_nvme": ("stage 3, optimizer state and parameter shards on NVMe",
                           {"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"}),
    "zero_auto": ("the least-offloaded of the above whose model states fit the memory measured at setup",
                  {"stage": 3, "auto": True}),
}


def preset_names() -> list[str]:
    """Names accepted by :meth:`ZeroConfig.preset`, in order of increasing savings (``zero_auto`` last)."""
    return list(PRESETS)


def _preset_key_or_none(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    key = name.strip().lower().replace("-", "_")
    return key if key in PRESETS else None


def _preset_key(name: Any, key: str | None = None) -> str:
    found = _preset_key_or_none(name)
    if found is None:
        hint = _suggest(str(name).lower().replace("-", "_"), PRESETS)
        listing = "; ".join(f"{n} ({desc})" for n, (desc, _) in PRESETS.items())
        raise ZeroConfigError(key, f"unknown preset {name!r}{hint}", f"Presets: {listing}.")
    return found
