"""``DeepSpeedStrategy``'s keyword arguments, accepted by ``ZeroStrategy`` with the same meaning.

Switching from DeepSpeed is one changed name: ``DeepSpeedStrategy(stage=3,
offload_optimizer=True, offload_parameters=True)`` becomes ``ZeroStrategy(...)`` with
the same arguments. Every argument of Lightning's ``DeepSpeedStrategy.__init__``
(lightning 2.6) is in exactly one table below:

* translated: built into the ``ds_config`` that DeepSpeedStrategy itself would build
  (``_create_default_config``), then read by the same importer as a DeepSpeed file
  (``zero_strategy._config.deepspeed``), so both routes mean one thing;
* no effect here (tuning knobs of DeepSpeed's buckets, AIO threads, its logging): accepted,
  with a warning naming them, since a run that ignores a setting should say so;
* unsupported: a clear error naming the argument and what to do instead.

``stage``, ``offload_optimizer``, ``nvme_path`` and ``config`` are ``ZeroStrategy``'s own
arguments with the same meaning (``offload_optimizer`` also takes ``True`` / ``False``);
``accelerator``, ``parallel_devices``, ``cluster_environment``, ``precision_plugin`` /
``precision``, ``process_group_backend`` and ``timeout`` are Lightning's DDP arguments.
One difference stays: ``DeepSpeedStrategy``'s default stage is 2, ``ZeroStrategy``'s is 3.
"""

from __future__ import annotations

from typing import Any

from .._config.deepspeed import translate_deepspeed
from ..config import ZeroConfig, ZeroConfigError

#: argument -> (section of the ds_config it goes to, key there)
TRANSLATED = {
    "offload_parameters": ("offload_param", None),
    "offload_params_device": ("offload_param", "device"),
    "params_buffer_count": ("offload_param", "buffer_count"),
    "params_buffer_size": ("offload_param", "buffer_size"),
    "offload_optimizer_device": ("offload_optimizer", "device"),
    "optimizer_buffer_count": ("offload_optimizer", "buffer_count"),
    "pin_memory": ("offload", "pin_memory"),
    "loss_scale": ("fp16", "loss_scale"),
    "initial_scale_power": ("fp16", "initial_scale_power"),
    "loss_scale_window": ("fp16", "loss_scale_window"),
    "hysteresis": ("fp16", "hysteresis"),
    "min_loss_scale": ("fp16", "min_loss_scale"),
}

#: argument -> why it changes nothing here (said in the warning)
NO_EFFECT = {
    "remote_device": "stage 3 builds the model on the meta device in configure_model (meta_init) and places "
                     "parameter shards where offload_parameters says",
    "contiguous_gradients": "gradients always live in one flat buffer per unit",
    "overlap_comm": "communication is always overlapped per unit",
    "allgather_partitions": "parameters are always all-gathered per unit",
    "reduce_scatter": "gradients are always reduce-scattered per unit (stages 2-3)",
    "allgather_bucket_size": "the all-gather bucket is one unit",
    "reduce_bucket_size": "the reduce-scatter bucket is one unit",
    "sub_group_size": "the optimizer steps per flat group; with NVMe, a group larger than buffer_size streams in chunks of it",
    "max_in_cpu": "NVMe parameter offload keeps no CPU cache of parameters",
    "block_size": "NVMe I/O is sized by NVMeOffload(buffer_size=...)",
    "queue_depth": "NVMe I/O is sized by NVMeOffload(io_threads=...)",
    "single_submit": "NVMe I/O is configured by NVMeOffload",
    "overlap_events": "NVMe I/O is configured by NVMeOffload",
    "thread_count": "NVMe I/O threads are NVMeOffload(io_threads=...)",
    "zero_allow_untested_optimizer": "any elementwise torch.optim optimizer is accepted",
    "logging_batch_size_per_gpu": "it only feeds DeepSpeed's throughput logging",
    "logging_level": "it sets DeepSpeed's logger",
    "contiguous_memory_optimization": "activation checkpoints are not partitioned (see partition_activations)",
    "synchronize_checkpoint_boundary": "activation checkpoints are not partitioned (see partition_activations)",
    "load_full_weights": "a single .ckpt file with full weights always loads (Trainer(ckpt_path=file))",
    "exclude_frozen_parameters": "checkpoints hold frozen parameters too (they are sharded like the rest)",
}

#: argument -> (the value that is refused, the message)
UNSUPPORTED = {
    "zero_optimization": (False, "zero_optimization=False is plain data parallel; use strategy='ddp'"),
    "partition_activations": (True, "zero_strategy does not partition activation checkpoints across ranks; "
                                    "use torch.utils.checkpoint (or the model's gradient_checkpointing_enable()) "
                                    "and drop partition_activations"),
    "cpu_checkpointing": (True, "zero_strategy does not move activation checkpoints to the CPU; use "
                                "torch.utils.checkpoint and drop cpu_checkpointing"),
}

#: what DeepSpeedStrategy writes into an offload section for the arguments not given
SECTION_DEFAULTS = {
    "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme", "buffer_count": 4, "pin_memory": False},
    "offload_param": {"device": "cpu", "nvme_path": "/local_nvme", "buffer_count": 5, "buffer_size": 100_000_000,
                      "pin_memory": False},
}

DEEPSPEED_ONLY = frozenset(TRANSLATED) | frozenset(NO_EFFECT) | frozenset(UNSUPPORTED)


def translate_deepspeed_kwargs(kwargs: dict[str, Any], offload_optimizer: Any, stage: Any
                               ) -> tuple[dict[str, Any], list[str]]:
    """DeepSpeedStrategy arguments -> (ZeroConfig field changes, names accepted without effect).

    ``offload_optimizer`` is passed when it is a bool (DeepSpeed's meaning); ``stage`` only
    makes the ds_config complete (the caller applies it).
    """
    for name, (refused, why) in UNSUPPORTED.items():
        if name in kwargs and bool(kwargs[name]) == refused:
            raise ZeroConfigError(name, f"= {kwargs[name]!r} is not supported", why[0].upper() + why[1:] + ".")
    sections: dict[str, dict[str, Any]] = {"offload_param": {}, "offload_optimizer": {}, "offload": {}, "fp16": {}}
    for name, (section, key) in TRANSLATED.items():
        if name in kwargs and key is not None:
            sections[section][key] = kwargs[name]
    zero: dict[str, Any] = {"stage": stage if isinstance(stage, int) else 3}
    changes: dict[str, Any] = {}
    for wanted, section, field in ((offload_optimizer, "offload_optimizer", "offload_optimizer"),
                                   (kwargs.get("offload_parameters"), "offload_param", "offload_params")):
        if wanted is True:  # with DeepSpeedStrategy's defaults for what is not given
            zero[section] = {**SECTION_DEFAULTS[section], **sections["offload"], **sections[section]}
        elif wanted is False:
            changes[field] = None
    ds: dict[str, Any] = {"zero_optimization": zero}
    if sections["fp16"]:
        ds["fp16"] = {"enabled": True, **sections["fp16"]}  # only the loss scale is taken from it
    translated = translate_deepspeed(ds).fields
    config = ZeroConfig.from_deepspeed(ds)  # validated: an error names the DeepSpeed key
    for key in ("offload_optimizer", "offload_params", "loss_scale"):
        if key in translated:
            changes[key] = getattr(config, key)
    ignored = [n for n in kwargs if n in NO_EFFECT]
    ignored += [n for n, (section, key) in TRANSLATED.items()  # e.g. offload_params_device without the offload
                if n in kwargs and key is not None and section.startswith("offload") and not _section_used(section, zero)]
    return changes, ignored


def _section_used(section: str, zero: dict) -> bool:
    if section == "offload":
        return "offload_param" in zero or "offload_optimizer" in zero
    return section in zero


def no_effect_message(names: list[str]) -> str:
    reasons = "; ".join(f"{n}: {NO_EFFECT.get(n, 'it applies only with the offload it configures turned on')}"
                        for n in names)
    return f"ZeroStrategy accepted DeepSpeedStrategy arguments that have no effect here ({reasons})."
