"""Where offloaded state lives and how fp16 scales its loss: the policy objects of a config.

Leaf of the configuration layer: ``config.py`` (``ZeroConfig`` holds these) and the
DeepSpeed translation (``deepspeed.py``, which builds them from a ``ds_config``) both
import them, so neither imports the other for them. The engine receives these objects
as they are (see [Note: normalisation] in config.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from .values import ZeroConfigError, _as_bool, _as_float, _as_int, _check_keys, _suggest

__all__ = ["CPUOffload", "NVMeOffload", "LossScaleConfig", "OffloadPolicy"]



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
    buffers can be used for O_DIRECT I/O: the size of one staging buffer and of one I/O
    request. The host memory staging takes is ``buffer_count`` (raised to what the
    pipeline holds at once) times ``buffer_size``, whatever the model: a flat group whose
    state is larger than a buffer streams through the buffers in chunks (See [Note:
    bounded staging] in _mechanisms/nvme_stream.py).
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
            "each buffer is a host staging slot of buffer_size bytes, and the pipeline never has more than "
            "read_ahead + 4 (plus stage 3's prefetch) in use, so more only hold memory"))
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
