"""Translate a DeepSpeed ``ds_config`` into :class:`~zero_strategy.config.ZeroConfig` fields.

Only the parts of a ``ds_config`` that decide what ZeRO does are read:
``zero_optimization``, ``fp16``, ``bf16`` (or ``bfloat16``), ``gradient_clipping`` and
``communication_data_type`` and ``sequence_parallel_size``. Every other top-level key DeepSpeed knows (batch sizes,
``optimizer``, ``scheduler``, monitors, ``activation_checkpointing``, ``aio``, ...)
belongs to the training loop or the front end: it is accepted, not used, listed in
:attr:`DeepSpeedTranslation.ignored`, and named in one WARNING (rank 0) that says what
is used instead (:data:`INSTEAD`). A key DeepSpeed does not know raises, with a "did
you mean" suggestion. ``"auto"`` values are resolved first, by the rules of
:mod:`zero_strategy._config.deepspeed_auto` (the same for every front end).

| DeepSpeed key | ZeroConfig field | notes |
|---|---|---|
| `zero_optimization.stage` | `stage` | 0 is an error (plain DDP); `"auto"` is an error |
| `zero_optimization.offload_optimizer.device` | `offload_optimizer` | `none` / `cpu` → `CPUOffload` / `nvme` → `NVMeOffload` |
| `zero_optimization.offload_optimizer.nvme_path` | `offload_optimizer.path` | |
| `zero_optimization.offload_optimizer.pin_memory` | `offload_optimizer.pin_memory` | |
| `zero_optimization.offload_optimizer.buffer_count` | `offload_optimizer.buffer_count` | nvme only |
| `zero_optimization.offload_param.device` | `offload_params` | needs stage 3 |
| `zero_optimization.offload_param.nvme_path` | `offload_params.path` | |
| `zero_optimization.offload_param.pin_memory` | `offload_params.pin_memory` | |
| `zero_optimization.offload_param.buffer_count` | `offload_params.buffer_count` | nvme only |
| `zero_optimization.offload_param.buffer_size` | `offload_params.buffer_size` | DeepSpeed counts elements: × 2 bytes, rounded up to 4096 |
| `zero_optimization.cpu_offload` (legacy) | `offload_optimizer` | `true` → `CPUOffload` |
| `zero_optimization.cpu_offload_param(s)` (legacy) | `offload_params` | `true` → `CPUOffload` |
| `zero_optimization.cpu_offload_use_pin_memory` (legacy) | `*.pin_memory` | for the legacy CPU offloads |
| `zero_optimization.stage3_param_persistence_threshold` | `param_persistence_threshold` | also without the `stage3_` prefix |
| `fp16.enabled` | `precision = "fp16"` | `"auto"`: the front end's precision (see _deepspeed_auto) |
| `fp16.loss_scale` | `loss_scale` | 0 = dynamic; > 0 = static scale (`initial_scale`, `static=True`) |
| `fp16.initial_scale_power` | `loss_scale.initial_scale` | `2**power` |
| `fp16.loss_scale_window` | `loss_scale.growth_interval` | |
| `fp16.hysteresis` | `loss_scale.hysteresis` | DeepSpeed's default 2 is used when absent |
| `fp16.min_loss_scale` | `loss_scale.min_scale` | |
| `bf16.enabled` / `bfloat16.enabled` | `precision = "bf16"` | fp16 and bf16 both enabled is an error |
| `gradient_clipping` | `gradient_clipping` | absent or `"auto"` → `None` (off in step(); the front end clips) |
| `communication_data_type` | `reduce_dtype` | `fp32` / `fp16` / `bf16` |
| `sequence_parallel_size` | `sequence_parallel_size` | Ulysses sequence parallelism; must divide the number of ranks |

Accepted with no effect (tuning knobs this engine sizes itself, or bookkeeping):
bucket sizes, `overlap_comm`, `contiguous_gradients`, `reduce_scatter`,
`allgather_partitions`, `round_robin_gradients`, `sub_group_size`,
`stage3_prefetch_bucket_size`, `stage3_max_live_parameters`,
`stage3_max_reuse_distance`, `stage3_gather_16bit_weights_on_model_save`,
`elastic_checkpoint`, `ignore_unused_parameters`, `load_from_fp32_weights`,
`memory_efficient_linear`, `offload_optimizer.{ratio, fast_init, pipeline_read,
pipeline_write}`, `offload_param.max_in_cpu`, `fp16.{consecutive_hysteresis,
auto_cast}`; their value may be `"auto"`.

Not supported (they change the numerics or the sharding layout), so they raise:
`zero_quantized_weights`, `zero_quantized_nontrainable_weights` and
`zero_quantized_gradients` set to true, `zero_hpz_partition_size` > 1,
`mics_shard_size` > 0, `fp16.fp16_master_weights_and_grads` and
`bf16.bf16_master_weights_and_grads` / `bf16_optimizer_states` set to true.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._logging import rank_zero_logger
from .deepspeed_auto import resolve_auto
from .policies import CPUOffload, NVMeOffload
from .values import ZeroConfigError, _check_keys, _finite

__all__ = ["DeepSpeedTranslation", "translate_deepspeed", "deepspeed_error", "INSTEAD"]

log = rank_zero_logger(__name__)  # see [Note: which rank logs] in _logging.py

# Top-level DeepSpeed keys that belong to the training loop / front end.
IGNORED_TOP_LEVEL = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "steps_per_print", "wall_clock_breakdown", "memory_breakdown",
    "dump_state", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "aio", "data_types", "amp", "prescale_gradients", "gradient_predivide_factor",
    "sparse_gradients", "checkpoint", "elasticity", "autotuning", "pipeline", "progressive_layer_drop",
    "curriculum_learning", "data_efficiency", "compression_training", "eigenvalue", "quantize_training",
    "sparse_attention", "nebula", "load_universal_checkpoint", "use_node_local_storage",
    "dataloader_drop_last", "disable_allgather", "fp32_allreduce", "timers", "graph_harvesting",
    "seq_parallel_communication_data_type", "torch_autocast", "compile", "weight_quantization",
    "hybrid_engine", "tensor_parallel", "zero_legacy_stage1", "communication_logging", "monitor_config",
})
MAPPED_TOP_LEVEL = ("zero_optimization", "fp16", "bf16", "bfloat16", "gradient_clipping",
                    "communication_data_type", "sequence_parallel_size")

_LOGGING = "logging and monitoring are the front end's (zs.memory_report / zs.comm_stats give memory and traffic)"
_CHECKPOINTS = ("checkpoints use zero_strategy's sharded format (save_checkpoint / the front end's save), "
                "which loads on any number of ranks")
#: a dropped top-level section -> what is used instead (named in the WARNING)
INSTEAD: dict[str, str] = {
    "optimizer": "your own optimizer is used (the one given to setup / accelerator.prepare / configure_optimizers, "
                 "or the HF Trainer's from TrainingArguments); build the same one, e.g. torch.optim.AdamW(...)",
    "scheduler": "your own LR scheduler is used (torch.optim.lr_scheduler, transformers.get_scheduler, or "
                 "TrainingArguments' lr_scheduler_type)",
    "data_types": "gradients are accumulated and reduced in reduce_dtype (default: the compute precision); "
                  "set communication_data_type: fp32 (ZeroConfig(reduce_dtype=\"fp32\")) to accumulate in fp32",
    "train_batch_size": "the batch size is your data loader's, per process",
    "train_micro_batch_size_per_gpu": "the batch size is your data loader's, per process",
    "gradient_accumulation_steps": "accumulation is the front end's (accumulate_grad_batches, "
                                   "Accelerator(gradient_accumulation_steps=...), TrainingArguments, or "
                                   "zero_strategy.no_sync in your own loop)",
    "activation_checkpointing": "use model.gradient_checkpointing_enable() or torch.utils.checkpoint "
                                "(supported at every stage)",
    "amp": "precision is ZeroConfig.precision or the front end's precision setting",
    "torch_autocast": "there is no autocast: parameters are in the compute dtype",
    "prescale_gradients": "gradients are averaged over ranks in the reduction, as DDP does",
    "gradient_predivide_factor": "gradients are averaged over ranks in the reduction, as DDP does",
    "fp32_allreduce": "set communication_data_type: fp32 to reduce in fp32",
    "sparse_gradients": "gradients are reduced dense",
    "zero_allow_untested_optimizer": "any elementwise torch.optim optimizer is accepted",
    "zero_force_ds_cpu_optimizer": "offloaded steps run your own optimizer on the CPU (AdamW(fused=True) is "
                                   "torch's fused CPU kernel)",
    "aio": "NVMe I/O is tuned in offload_optimizer / offload_params (buffer_size, buffer_count, io_threads)",
    **{k: _LOGGING for k in ("steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state",
                             "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
                             "communication_logging", "monitor_config", "timers")},
    **{k: _CHECKPOINTS for k in ("checkpoint", "load_universal_checkpoint", "use_node_local_storage", "nebula")},
}
NOT_USED = "not used: it configures a DeepSpeed feature zero_strategy does not have"

# zero_optimization keys that are tuning knobs or bookkeeping: accepted, no effect.
ZERO_NO_EFFECT = frozenset({
    "reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
    "reduce_scatter", "allgather_partitions", "round_robin_gradients", "sub_group_size",
    "stage3_prefetch_bucket_size", "prefetch_bucket_size", "stage3_max_live_parameters",
    "max_live_parameters", "stage3_max_reuse_distance", "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "elastic_checkpoint", "ignore_unused_parameters",
    "load_from_fp32_weights", "memory_efficient_linear", "legacy_stage1", "use_multi_rank_bucket_allreduce",
    "stage3_model_persistence_threshold", "model_persistence_threshold",
    "stage3_module_granularity_threshold", "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
    "mics_hierarchical_params_gather", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "zeropp_loco_param", "leaf_module",
})
ZERO_MAPPED = ("stage", "offload_optimizer", "offload_param", "cpu_offload", "cpu_offload_param",
               "cpu_offload_params", "cpu_offload_use_pin_memory", "stage3_param_persistence_threshold",
               "param_persistence_threshold")
ZERO_UNSUPPORTED = ("zero_quantized_weights", "zero_quantized_nontrainable_weights",
                    "zero_quantized_gradients", "zero_hpz_partition_size", "mics_shard_size")

OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "pin_memory", "buffer_count", "ratio", "fast_init",
                          "pipeline_read", "pipeline_write", "pipeline")
OFFLOAD_PARAM_KEYS = ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu")
FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "min_loss_scale", "consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads")
BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "check_overflow",
             "bf16_master_weights_and_grads", "bf16_optimizer_states")

DEEPSPEED_FP16_HYSTERESIS_DEFAULT = 2
DEEPSPEED_ELEMENT_BYTES = 2  # offload_param.buffer_size counts (16-bit) elements


@dataclass(frozen=True)
class DeepSpeedTranslation:
    """The result of reading a ``ds_config``.

    ``fields`` are :class:`ZeroConfig` keyword arguments; ``ignored`` names the keys
    that were accepted without effect (dotted paths), for the front end to report.
    """

    fields: dict
    ignored: tuple[str, ...]
    dropped: tuple[str, ...] = ()  # the top-level sections among ``ignored``

    def report(self) -> None:
        """Log what was not used: once the fields are known to make a valid config."""
        if self.dropped:
            log.warning("DeepSpeed config: %d section(s) not used by zero_strategy:\n%s", len(self.dropped),
                        "\n".join(f"  {key}: {INSTEAD.get(key, NOT_USED)}" for key in self.dropped))
        knobs = [k for k in self.ignored if k not in self.dropped]
        if knobs:
            log.info("DeepSpeed config: accepted without effect on ZeRO (tuning knobs the engine sizes itself, or "
                     '"auto" supplied by the front end): %s', ", ".join(knobs))


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _no_auto(key: str, value: Any, example: str) -> Any:
    if _is_auto(value):
        raise ZeroConfigError(key, 'is "auto", which only the Hugging Face Trainer integration resolves',
                              f"Replace \"auto\" with a value, e.g. {example}.")
    return value


def _section(data: Mapping, key: str) -> Mapping:
    value = data.get(key) or {}
    if not isinstance(value, Mapping):
        raise ZeroConfigError(key, f"expected a mapping, got {value!r}", f'Write "{key}": {{...}}.')
    return value


def _enabled(section: Mapping, name: str) -> bool:
    value = section.get("enabled", False)
    if _is_auto(value):
        raise ZeroConfigError(f"{name}.enabled", '"auto" must be resolved by the front end before import',
                              "Set it to true or false (the HF Trainer resolves it from --fp16/--bf16).")
    if not isinstance(value, bool):
        raise ZeroConfigError(f"{name}.enabled", f"expected true or false, got {value!r}", "Write true or false.")
    return value


def _truthy(key: str, value: Any) -> bool:
    if _is_auto(value):
        return False
    if not isinstance(value, bool):
        raise ZeroConfigError(key, f"expected true or false, got {value!r}", "Write true or false.")
    return value


def _offload(key: str, section: Any, allowed: tuple[str, ...], ignored: list[str]) -> CPUOffload | NVMeOffload | None:
    if not isinstance(section, Mapping):
        raise ZeroConfigError(key, f"expected a mapping, got {section!r}", 'Write {"device": "cpu"}.')
    _check_keys(section, allowed, key)
    device = str(_no_auto(f"{key}.device", section.get("device", "none"), '"cpu"')).lower()
    if device not in ("none", "cpu", "nvme"):
        raise ZeroConfigError(f"{key}.device", f"unknown device {device!r}", 'Use "none", "cpu" or "nvme".')
    for name in section:
        if name not in ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size"):
            ignored.append(f"{key}.{name}")
    if device == "none":
        return None
    pin = _no_auto(f"{key}.pin_memory", section.get("pin_memory", False), "true")
    if device == "cpu":
        try:
            return CPUOffload(pin_memory=pin)
        except ZeroConfigError as err:
            raise err.within(key) from None
    kwargs: dict[str, Any] = {"pin_memory": pin}
    if section.get("nvme_path") is not None:
        kwargs["path"] = _no_auto(f"{key}.nvme_path", section["nvme_path"], '"/local_nvme"')
    if "buffer_count" in section:
        kwargs["buffer_count"] = _no_auto(f"{key}.buffer_count", section["buffer_count"], "4")
    if "buffer_size" in section:
        elements = _no_auto(f"{key}.buffer_size", section["buffer_size"], "1e8")
        if not isinstance(elements, (int, float)) or isinstance(elements, bool) or not _finite(elements) \
                or elements <= 0 or elements > 1 << 40:
            raise ZeroConfigError(f"{key}.buffer_size", f"expected a positive element count, got {elements!r}",
                                  "Write a number of elements such as 1e8.")
        kwargs["buffer_size"] = math.ceil(elements * DEEPSPEED_ELEMENT_BYTES / 4096) * 4096
    try:
        return NVMeOffload(**kwargs)
    except ZeroConfigError as err:
        err = err.within(key)
        raise ZeroConfigError(err.key.replace(".path", ".nvme_path"), err.problem, err.fix) from None


def _zero_section(zero: Mapping, fields: dict, ignored: list[str]) -> None:
    where = "zero_optimization"
    _check_keys(zero, [*ZERO_MAPPED, *ZERO_NO_EFFECT, *ZERO_UNSUPPORTED], where)
    for name in ZERO_UNSUPPORTED:
        value = zero.get(name)
        if value is None or _is_auto(value):
            continue
        if name.startswith("zero_quantized"):
            if not isinstance(value, bool):  # "true" would be ignored: refuse what it asks for instead
                raise ZeroConfigError(f"{where}.{name}", f"expected true or false, got {value!r}",
                                      "Write false (no quotes): zero_strategy does not quantize.")
            bad = value
        else:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ZeroConfigError(f"{where}.{name}", f"expected an integer, got {value!r}",
                                      f"Write {1 if 'hpz' in name else 0} (no quotes) or remove it.")
            bad = value > (1 if name == "zero_hpz_partition_size" else 0)
        if bad:
            raise ZeroConfigError(f"{where}.{name}", f"= {value!r} is not supported by zero_strategy "
                                  "(it changes the numerics or the sharding layout)",
                                  f"Remove {name} or set it to its default "
                                  f"({'false' if name.startswith('zero_quantized') else 1 if 'hpz' in name else 0}).")
        ignored.append(f"{where}.{name}")
    if "stage" not in zero:
        raise ZeroConfigError(f"{where}.stage", "is missing (DeepSpeed's default 0 is plain data parallel)",
                              "Add \"stage\": 1, 2 or 3.")
    stage = _no_auto(f"{where}.stage", zero["stage"], '"stage": 3')
    if stage == 0 and not isinstance(stage, bool):
        raise ZeroConfigError(f"{where}.stage", "stage 0 is plain DDP (nothing is sharded)",
                              "Use torch DDP, or stage 1 to shard the optimizer state.")
    fields["stage"] = stage
    legacy_pin = _truthy(f"{where}.cpu_offload_use_pin_memory", zero.get("cpu_offload_use_pin_memory", False))
    if "offload_optimizer" in zero and zero["offload_optimizer"] is not None:
        fields["offload_optimizer"] = _offload(f"{where}.offload_optimizer", zero["offload_optimizer"],
                                               OFFLOAD_OPTIMIZER_KEYS, ignored)
    elif _truthy(f"{where}.cpu_offload", zero.get("cpu_offload", False)):
        fields["offload_optimizer"] = CPUOffload(pin_memory=legacy_pin)
    if "offload_param" in zero and zero["offload_param"] is not None:
        fields["offload_params"] = _offload(f"{where}.offload_param", zero["offload_param"],
                                            OFFLOAD_PARAM_KEYS, ignored)
    else:
        for legacy in ("cpu_offload_param", "cpu_offload_params"):
            if _truthy(f"{where}.{legacy}", zero.get(legacy, False)):
                fields["offload_params"] = CPUOffload(pin_memory=legacy_pin)
    for name in ("stage3_param_persistence_threshold", "param_persistence_threshold"):
        if name in zero and not _is_auto(zero[name]):
            fields["param_persistence_threshold"] = zero[name]
        elif name in zero:
            ignored.append(f"{where}.{name}")
    ignored.extend(f"{where}.{name}" for name in zero if name in ZERO_NO_EFFECT)


def _precision_sections(data: Mapping, fields: dict, ignored: list[str], from_front_end: tuple[str, ...]) -> None:
    fp16 = _section(data, "fp16")
    _check_keys(fp16, FP16_KEYS, "fp16")
    if "bf16" in data and "bfloat16" in data:
        raise ZeroConfigError("bfloat16", 'both "bf16" and "bfloat16" sections are given',
                              'Keep only "bf16" (bfloat16 is its old name).')
    bf16_name = "bfloat16" if "bfloat16" in data else "bf16"
    bf16 = _section(data, bf16_name)
    _check_keys(bf16, BF16_KEYS, bf16_name)
    fp16_on, bf16_on = _enabled(fp16, "fp16"), _enabled(bf16, bf16_name)
    if fp16_on and bf16_on:
        raise ZeroConfigError(None, "fp16.enabled and bf16.enabled are both true",
                              "Enable one of them (bf16 on hardware that has it).")
    for section, keys in ((bf16_name, ("bf16_master_weights_and_grads", "bf16_optimizer_states")),
                          ("fp16", ("fp16_master_weights_and_grads",))):
        for name in keys:
            value = (bf16 if section == bf16_name else fp16).get(name, False)
            if not isinstance(value, bool) and not _is_auto(value):
                raise ZeroConfigError(f"{section}.{name}", f"expected true or false, got {value!r}",
                                      "Write false (no quotes): master weights are always fp32 here.")
    for name in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if bf16.get(name) is True:
            raise ZeroConfigError(f"{bf16_name}.{name}", "is not supported: master weights and optimizer "
                                  "state are always fp32 here", f"Remove {name} or set it to false.")
    if fp16.get("fp16_master_weights_and_grads") is True:
        raise ZeroConfigError("fp16.fp16_master_weights_and_grads", "is not supported: master weights are "
                              "always fp32 here", "Remove it or set it to false.")
    ignored.extend(f"{bf16_name}.{k}" for k in bf16 if k != "enabled")
    if bf16_on:
        fields["precision"] = "bf16"
    if not fp16_on and "fp16" not in from_front_end:
        ignored.extend(f"fp16.{k}" for k in fp16 if k != "enabled")
        return
    if fp16_on:
        fields["precision"] = "fp16"
    # else fp16.enabled was "auto": the loss scale is read for a front end that picks fp16
    scale: dict[str, Any] = {"hysteresis": DEEPSPEED_FP16_HYSTERESIS_DEFAULT}
    static = _no_auto("fp16.loss_scale", fp16.get("loss_scale", 0), "0 (dynamic)")
    if not isinstance(static, (int, float)) or isinstance(static, bool) or not _finite(static) or static < 0:
        raise ZeroConfigError("fp16.loss_scale", f"expected 0 (dynamic) or a positive scale, got {static!r}",
                              "Write 0 for dynamic loss scaling or e.g. 1024 for a static scale.")
    if static > 0:
        scale.update(initial_scale=float(static), static=True, min_scale=min(1.0, float(static)))
    elif "initial_scale_power" in fp16:
        power = _no_auto("fp16.initial_scale_power", fp16["initial_scale_power"], "16")
        if not isinstance(power, int) or isinstance(power, bool) or not 0 <= power <= 127:
            raise ZeroConfigError("fp16.initial_scale_power", f"expected an integer in [0, 127] (2**power must "
                                  f"be a finite fp32 scale), got {power!r}", "Write e.g. 16.")
        scale["initial_scale"] = 2.0**power
    for ds_name, ours in (("loss_scale_window", "growth_interval"), ("hysteresis", "hysteresis"),
                          ("min_loss_scale", "min_scale")):
        if ds_name in fp16:
            scale[ours] = _no_auto(f"fp16.{ds_name}", fp16[ds_name], "1000")
    ignored.extend(f"fp16.{k}" for k in ("consecutive_hysteresis", "auto_cast") if k in fp16)
    fields["loss_scale"] = scale


# Our field (or dotted sub-field) -> the DeepSpeed key it was read from, for error messages.
_SOURCE_KEYS = {
    "stage": "zero_optimization.stage",
    "offload_optimizer": "zero_optimization.offload_optimizer",
    "offload_params": "zero_optimization.offload_param",
    "param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "gradient_clipping": "gradient_clipping",
    "reduce_dtype": "communication_data_type",
    "loss_scale.initial_scale": "fp16.initial_scale_power",
    "loss_scale.growth_interval": "fp16.loss_scale_window",
    "loss_scale.hysteresis": "fp16.hysteresis",
    "loss_scale.min_scale": "fp16.min_loss_scale",
}


def deepspeed_error(err: ZeroConfigError) -> ZeroConfigError:
    """``err``, raised while building a config from translated fields, named by the DeepSpeed key."""
    key = _SOURCE_KEYS.get(err.key or "", err.key)
    if err.key and err.key.startswith("loss_scale.") and err.key not in _SOURCE_KEYS:
        key = "fp16." + err.key.split(".", 1)[1]
    return ZeroConfigError(key, err.problem, err.fix)


def translate_deepspeed(data: Mapping) -> DeepSpeedTranslation:
    """Map a parsed ``ds_config`` to ZeroConfig keyword arguments (see the module table).

    The fields are not validated here: ``ZeroConfig.from_deepspeed`` builds the config,
    renames an error's key with :func:`deepspeed_error` and then calls ``report()``.
    """
    if not isinstance(data, Mapping):
        raise ZeroConfigError(None, f"a DeepSpeed config must be a mapping, got {type(data).__name__}",
                              "Pass the parsed ds_config dict or a path to it.")
    _check_keys(data, [*MAPPED_TOP_LEVEL, *IGNORED_TOP_LEVEL], None)
    fields: dict[str, Any] = {}
    auto = resolve_auto(data)  # see [Note: "auto" means "the front end supplies it"]
    data = auto.data
    dropped = [key for key in data if key in IGNORED_TOP_LEVEL]
    ignored = list(dropped) + [k for k in auto.resolved if k.split(".")[0] not in auto.precision_from_front_end]
    if "zero_optimization" not in data:
        raise ZeroConfigError("zero_optimization", "is missing, so DeepSpeed would run stage 0 (plain DDP)",
                              'Add "zero_optimization": {"stage": 1, 2 or 3}.')
    _zero_section(_section(data, "zero_optimization"), fields, ignored)
    _precision_sections(data, fields, ignored, auto.precision_from_front_end)
    clip = data.get("gradient_clipping")
    if clip is not None:
        fields["gradient_clipping"] = _no_auto("gradient_clipping", clip, "1.0")
    comm = data.get("communication_data_type")
    if comm is not None:
        fields["reduce_dtype"] = _no_auto("communication_data_type", comm, '"fp32"')
    sp = data.get("sequence_parallel_size")
    if sp is not None:
        fields["sequence_parallel_size"] = _no_auto("sequence_parallel_size", sp, "2")
    return DeepSpeedTranslation(fields=fields, ignored=tuple(ignored), dropped=tuple(dropped))
