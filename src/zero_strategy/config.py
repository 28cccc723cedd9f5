"""Public configuration of the ZeRO engine: typed, frozen, validated once.

The configuration layer (docs/architecture.md): everything a user can set lives here as
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
from typing import Any

import torch

from ._config.deepspeed import DeepSpeedTranslation, deepspeed_error, translate_deepspeed
from ._config.policies import (CPUOffload, LossScaleConfig, NVMeOffload, OffloadPolicy,  # public here too
                               _as_loss_scale, _as_offload, _offload_to_dict)
from ._config.values import (_DTYPES, FILE_SUFFIXES, ZeroConfigError, _as_bool,  # ZeroConfigError is public here too
                             _as_dtype_name, _as_float, _as_generation_offload, _as_int, _as_unit_classes, _check_keys,
                             _suggest, looks_like_deepspeed, read_mapping_file)

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



# ------------------------------------------------------------------ the config

#: ``ZeroConfig.optimizer_layout`` values: the layout follows the optimizer, or whole parameters for all
OPTIMIZER_LAYOUTS = ("auto", "owned")


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
            by ``optimizer.step()``: that backward already applies the step, which cannot be
            undone. So dropping its gradients before ``step()`` (``zero_grad()`` to skip a
            batch), a forward or a second backward before ``step()``, and clearing gradients
            between backward and ``step()`` raise at once (:class:`OverlapStepCommitted` when
            the step was completed first; See [Note: a step overlap_step began is not undone]
            in _optim/optimizer.py). To skip a batch, decide before its backward or run it
            inside ``no_sync()``. It cannot combine with clipping or fp16, which need every
            gradient before the first update.
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
        optimizer_layout: how an optimizer's state is split over ranks. ``"auto"``: an
            elementwise optimizer (AdamW, SGD, ...) steps contiguous 1/N slices of each flat
            buffer; a per-tensor one (``torch.optim.Muon``, ``torch.optim.Adafactor``, the
            list in ``_optim/optimizer.py``) steps whole parameters, each owned by one rank
            (the *ownership layout*, See [Note: the ownership layout] in _engine/flat.py).
            ``"owned"``: every optimizer steps whole parameters, for an optimizer of your
            own that reads only its own parameter's gradient and state.
        release_host_memory: give the host memory freed by training back to the operating
            system where a phase ends (the first evaluation or generation forward after a
            step; around each save, load and full state dict; the end of setup), never
            between steps, whose next step would take it again (glibc's ``malloc_trim``; a
            no-op without glibc), so the process holds what it uses rather than what it once
            freed. See [Note: releases where a phase ends] in _mechanisms/memory.py.
        async_save: ``zero_strategy.save_checkpoint`` (and every front end's save: Lightning's
            ``trainer.save_checkpoint`` and ``ModelCheckpoint``, Accelerate's ``save_state``, the
            Hugging Face Trainer's checkpoints) returns once this rank's shards are copied into host
            buffers, and a background thread writes them; the checkpoint appears complete (or not at
            all) when the write ends. The next save, ``load_checkpoint``, ``teardown``,
            ``zero_strategy.checkpoint.wait_for_save`` and the end of a Lightning fit wait for it and
            raise its error. See [Note: asynchronous saves] in checkpoint/_save.py.
        async_save_staging_bytes: the most host memory an asynchronous save holds staged on one rank;
            ``None``: one copy of the rank's checkpoint files. A smaller limit makes the save wait
            for the disk once that much is staged (the save returns when the rest fits).
        tiled_loss: a Hugging Face ``*ForCausalLM`` called with ``labels`` (or ``shift_labels``) in
            training mode computes its head and loss chunk by chunk over the tokens, recomputed in
            backward, so the (tokens x vocab) logits never exist whole; ``outputs.logits`` is then
            None. ``True`` picks the chunk (an eighth of the tokens, at most 64 MiB of fp32 logits),
            an integer is the chunk in tokens; ``False`` (default) leaves the model's own loss. See
            [Note: the tiled loss] in _model/tiled_loss.py.
        tiled_mlp: each gated MLP (``gate_proj``/``up_proj``/``down_proj``: Llama, Mistral, Qwen)
            runs over chunks of the sequence in training, recomputed in backward, so it keeps one
            chunk's intermediates instead of the sequence's. ``True``: chunks of as many tokens as
            the hidden size; an integer: the chunk in tokens. See [Note: the tiled MLP] in
            _model/tiled_mlp.py.
        activation_offload: with gradient checkpointing on (a Hugging Face model's
            ``gradient_checkpointing_enable()``), the inputs each checkpointed layer keeps for its
            recomputation wait on the host instead of the device (pinned buffers, copied on a side
            stream); on a CPU run they are already there. See [Note: activation offload] in
            _model/activation_offload.py.
        sequence_parallel_size: Ulysses sequence parallelism: groups of this many consecutive
            ranks share each sample, every rank holding 1/N of its sequence, with an all-to-all
            from sequence shards to head shards around attention (DeepSpeed's key of the same
            name). It must divide the number of ranks; the other factor is data parallel, and
            ZeRO still shards over every rank. 1: off. See [Note: sequence parallelism] in
            _model/sequence_parallel.py and docs/guides/long-sequences.md.
        seq_len: ``zero_auto`` only: the tokens of each sequence a training step reads (the whole
            sequence: ``sequence_parallel_size`` divides it). Setup then estimates the activations
            of each candidate preset (a Llama-style transformers model) and counts them beside its
            model states, adding the tiled loss, the tiled MLP and activation offload where they do
            not fit, as ``choose_preset(model, seq_len=...)`` does (See [Note: zero_auto] in
            _zero_auto.py). ``None``: activations are left to zero_auto's headroom. A named preset
            refuses it: there is nothing to choose (``zero-strategy estimate --seq-len`` estimates a
            preset's activations).
        batch_size: ``zero_auto`` with ``seq_len``: the sequences of that length each rank's
            forward takes at once (its micro-batch).
        expert_parallel_size: expert parallelism for the mixture-of-experts layers of a
            transformers 5 model (fused ``experts.gate_up_proj`` / ``down_proj``): each rank
            holds whole experts, ``num_experts / N`` of each layer, never gathered, and tokens
            travel to their experts and back by all-to-all (DeepSpeed MoE's ``ep_size``). N must
            divide the number of ranks: groups of N consecutive ranks each hold every expert and
            are data-parallel replicas of each other. 1: off. See [Note: expert parallelism] in
            _model/expert_parallel.py and docs/guides/mixture-of-experts.md.
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
    optimizer_layout: str = "auto"
    release_host_memory: bool = True
    async_save: bool = False
    async_save_staging_bytes: int | None = None
    tiled_loss: bool | int = False
    tiled_mlp: bool | int = False
    activation_offload: bool = False
    sequence_parallel_size: int = 1
    seq_len: int | None = None
    batch_size: int = 1
    expert_parallel_size: int = 1

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
        _as_bool("release_host_memory", self.release_host_memory)
        _as_bool("activation_offload", self.activation_offload)
        set_("tiled_loss", _as_chunk("tiled_loss", self.tiled_loss))
        set_("tiled_mlp", _as_chunk("tiled_mlp", self.tiled_mlp))
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
        set_("sequence_parallel_size", _as_int("sequence_parallel_size", self.sequence_parallel_size, 1))
        set_("expert_parallel_size", _as_int("expert_parallel_size", self.expert_parallel_size, 1))
        set_("batch_size", _as_int("batch_size", self.batch_size, 1))
        if self.seq_len is not None:
            set_("seq_len", _as_int("seq_len", self.seq_len, 1))
            if not self.auto:
                raise ZeroConfigError("seq_len", "is read by zero_auto only, to count a step's activations when "
                                      "it chooses a preset; a named preset has nothing to choose",
                                      "Use preset: zero_auto, or drop seq_len (zero-strategy estimate --seq-len "
                                      "estimates a named preset's activations).")
        elif self.batch_size != 1:
            raise ZeroConfigError("batch_size", "is the micro-batch of zero_auto's activation estimate and "
                                  "needs seq_len", "Set seq_len (with preset: zero_auto), or drop batch_size.")
        set_("offload_states_during_generation",
             _as_generation_offload(self.offload_states_during_generation))
        if self.optimizer_layout not in OPTIMIZER_LAYOUTS:
            raise ZeroConfigError("optimizer_layout", f"must be one of {list(OPTIMIZER_LAYOUTS)}, got "
                                  f"{self.optimizer_layout!r}{_suggest(str(self.optimizer_layout), OPTIMIZER_LAYOUTS)}",
                                  "Use 'auto' (the layout follows the optimizer), or 'owned' to step whole "
                                  "parameters with any per-tensor optimizer.")
        _as_bool("async_save", self.async_save)
        if self.async_save_staging_bytes is not None:
            set_("async_save_staging_bytes", _as_int("async_save_staging_bytes", self.async_save_staging_bytes, 1))
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
            **({"optimizer_layout": self.optimizer_layout} if self.optimizer_layout != "auto" else {}),
            **({} if self.release_host_memory else {"release_host_memory": False}),
            **({"async_save": True} if self.async_save else {}),
            **({"async_save_staging_bytes": self.async_save_staging_bytes}
               if self.async_save_staging_bytes is not None else {}),
            **({"tiled_loss": self.tiled_loss} if self.tiled_loss is not False else {}),
            **({"tiled_mlp": self.tiled_mlp} if self.tiled_mlp is not False else {}),
            **({"activation_offload": True} if self.activation_offload else {}),
            **({"sequence_parallel_size": self.sequence_parallel_size} if self.sequence_parallel_size > 1 else {}),
            **({"expert_parallel_size": self.expert_parallel_size} if self.expert_parallel_size > 1 else {}),
            **({"seq_len": self.seq_len} if self.seq_len is not None else {}),
            **({"batch_size": self.batch_size} if self.batch_size != 1 else {}),
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
        """Translate a DeepSpeed ``ds_config`` (see :mod:`zero_strategy._config.deepspeed`).

        Errors name the DeepSpeed key (``zero_optimization.offload_optimizer.buffer_count``),
        not ours; the sections and knobs without effect are logged once the config is valid.
        """
        if isinstance(path_or_dict, Mapping):
            return cls._from_translation(translate_deepspeed(path_or_dict))
        source = str(path_or_dict)
        data = read_mapping_file(Path(path_or_dict))
        try:
            return cls._from_translation(translate_deepspeed(data))
        except ZeroConfigError as err:
            raise err.from_source(source) from None

    @classmethod
    def _from_translation(cls, translation: DeepSpeedTranslation) -> ZeroConfig:
        try:
            config = cls(**translation.fields)
        except ZeroConfigError as err:
            raise deepspeed_error(err) from None
        translation.report()
        return config

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


def _as_chunk(key: str, value: Any) -> bool | int:
    """``tiled_loss`` / ``tiled_mlp``: true (the default chunk), false, or a chunk of at least 1 token."""
    if isinstance(value, bool):
        return value
    chunk = value if isinstance(value, (int, float)) else None
    if chunk is None or not chunk >= 1 or (isinstance(chunk, float) and not chunk.is_integer()):
        raise ZeroConfigError(key, f"expected true, false or a chunk of at least 1 token, got {value!r}",
                              "Write true (the default chunk), false, or e.g. 1024.")
    return int(chunk)


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
