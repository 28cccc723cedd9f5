"""What kind of launch a ZeroAccelerator accepts, checked before and after Accelerate sets up.

[Note: distributed types]
ZeroAccelerator keeps the data-parallel launch Accelerate already knows (``NO``,
``MULTI_GPU``, ``MULTI_CPU`` and the other ``MULTI_*`` device types) and replaces only
what DDP would do to the model and optimizer. An ``FSDP`` or Megatron launch would
shard the model a second time, so it is refused with the fix: launch with a
MULTI_GPU-type config (recipes/accelerate/).

[Note: adopting a DeepSpeed launch]
A ``distributed_type: DEEPSPEED`` accelerate config is what a DeepSpeed user already
has, and the switch should be one line (``from zero_strategy.accelerate import
Accelerator``). ``accelerate launch`` starts its processes with torchrun and describes
the DeepSpeed setup in environment variables (``ACCELERATE_USE_DEEPSPEED=true``,
``ACCELERATE_DEEPSPEED_CONFIG_FILE`` or the inline ``ACCELERATE_DEEPSPEED_ZERO_STAGE``,
``..._OFFLOAD_OPTIMIZER_DEVICE``, ...). Left alone, Accelerate's state would start
DeepSpeed's communication backend and build a DeepSpeed plugin. So before anything
reads them, :func:`adopt_deepspeed_launch` turns ``ACCELERATE_USE_DEEPSPEED`` off (the
processes then set up as an ordinary data-parallel launch) and remembers the launch;
:func:`deepspeed_launch_config` rebuilds the ds_config exactly as Accelerate's
``DeepSpeedPlugin`` would (the file, or the inline keys with its defaults: stage 2,
``gradient_clipping`` "auto"), which ZeroAccelerator then uses as its ZeRO config. Two
things Accelerate's DeepSpeed integration fills in are kept: ``"auto"``
``gradient_clipping`` becomes 1.0 (clipped inside ``step()``), and a numeric
``gradient_accumulation_steps`` in the file wins over the Accelerator's. The HF Trainer's
DeepSpeed integration does otherwise, and ``ZeroTrainer`` follows it: "auto" clipping is
the Trainer's ``max_grad_norm`` (the Trainer clips), and a numeric accumulation must equal
``TrainingArguments.gradient_accumulation_steps``.

[Note: CPU-only machines]
``accelerate launch`` with a MULTI_GPU config starts N processes, but on a machine
without GPUs each of them sets itself up as a lone, non-distributed process unless
``ACCELERATE_USE_CPU`` is set (accelerate 1.x: ``use_cpu: true`` in the config and
``--cpu`` do not reach the processes of a multi-GPU launch; ``--cpu`` and a
MULTI_CPU config start one process only without mpirun). N lone processes would each
train the whole model on their share of nothing in common, silently. So when N > 1
processes were launched and no accelerator device exists, we set
``ACCELERATE_USE_CPU=true`` in this process before Accelerate (or a
``TrainingArguments``) reads it: N CPU processes on gloo, as the launch asked. If
the state was already made without it, :func:`check_after_init` says how to fix it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .._config.deepspeed_auto import is_auto
from .._config.values import read_mapping_file
from .._logging import rank_zero_logger

logger = rank_zero_logger("zero_strategy.accelerate")

#: set (to "1") in a process whose DeepSpeed launch was adopted; see [Note: adopting a DeepSpeed launch]
ADOPTED_ENV = "ZERO_STRATEGY_ADOPTED_DEEPSPEED_LAUNCH"
#: what Accelerate's DeepSpeed integration puts in an "auto" gradient_clipping (Accelerator._prepare_deepspeed)
ACCELERATE_DEEPSPEED_AUTO_CLIPPING = 1.0

RECIPES_HINT = ("launch with a MULTI_GPU-type accelerate config instead "
                "(recipes/accelerate/multi_gpu.yaml, or recipes/accelerate/cpu_2proc.yaml on CPUs) and choose the "
                "ZeRO preset with ZeroAccelerator(zero_config=...) or ZERO_STRATEGY_CONFIG")


def refuse_sharding_launchers(kwargs: dict) -> None:
    """Refuse DeepSpeed/FSDP/Megatron launches and plugins before Accelerate builds them."""
    for key in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin"):
        if kwargs.get(key) is not None:
            raise ValueError(f"ZeroAccelerator shards the model itself and cannot take {key}=...; "
                             f"pass zero_config=... instead (a DeepSpeed ds_config is accepted there)")
    for env, kind in (("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_MEGATRON_LM", "MEGATRON_LM")):
        if os.environ.get(env, "false").strip().lower() in ("1", "true", "yes"):
            raise ValueError(f"ZeroAccelerator: this process was launched with distributed type {kind} "
                             f"({env}=true); ZeroAccelerator does the sharding itself, so {RECIPES_HINT}")
    refuse_model_parallel_sizes(kwargs.get("parallelism_config"))


#: ParallelismConfig's sizes ZeroAccelerator cannot honour, with the launch config's environment variable
_UNSUPPORTED_SIZES = {"tp_size": ("PARALLELISM_CONFIG_TP_SIZE", "tensor parallelism"),
                      "cp_size": ("PARALLELISM_CONFIG_CP_SIZE", "context parallelism")}


def _from_launch(parallelism_config) -> bool:
    return parallelism_config is None and _env_true("ACCELERATE_USE_PARALLELISM_CONFIG")


def refuse_model_parallel_sizes(parallelism_config) -> None:
    """Refuse tp/cp sizes above 1, passed as ``parallelism_config`` (also through
    ``TrainingArguments(parallelism_config=...)``) or asked for by the launch config, before
    Accelerate builds its mesh: ZeRO is data parallel, and running such a launch as plain data
    parallelism would train other samples on each rank where the user asked for one split.
    (``sp_size`` is honoured: See [Note: sequence parallelism under Accelerate] in _accelerator.py.)"""
    from_env = _from_launch(parallelism_config)
    for key, (env, what) in _UNSUPPORTED_SIZES.items():
        size = getattr(parallelism_config, key, None) if parallelism_config is not None else None
        if from_env:
            size = int(os.environ.get(env, "1") or 1)
        if size is not None and size > 1:
            where = f"{env}={size} in the launch config" if from_env else f"ParallelismConfig({key}={size})"
            raise ValueError(
                f"ZeroAccelerator: {what} ({where}) is not supported: ZeRO shards model states across "
                f"data-parallel ranks, and running this launch as data parallelism would give each rank "
                f"other samples instead of a share of one. Set {key} to 1 (or remove it); for long "
                "sequences use sequence parallelism instead (ParallelismConfig(sp_backend='deepspeed', sp_size=N))")


def requested_parallelism(parallelism_config):
    """The ``ParallelismConfig`` this launch asks for (given, or built from the launch config's
    ``PARALLELISM_CONFIG_*`` variables as Accelerate would), else None."""
    if _from_launch(parallelism_config):
        from accelerate.parallelism_config import ParallelismConfig

        return ParallelismConfig()
    return parallelism_config


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def adopt_deepspeed_launch() -> bool:
    """Turn a DEEPSPEED accelerate launch into a data-parallel one for ZeroAccelerator; True if this process was one.

    See [Note: adopting a DeepSpeed launch]. Idempotent; must run before Accelerate's
    state (or a ``TrainingArguments``) is created.
    """
    if _env_true("ACCELERATE_USE_DEEPSPEED"):
        os.environ[ADOPTED_ENV] = "1"
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
    return os.environ.get(ADOPTED_ENV) == "1"


def deepspeed_launch_config(auto_clipping: float | None = ACCELERATE_DEEPSPEED_AUTO_CLIPPING) -> tuple[dict, str] | None:
    """``(ds_config, where it came from)`` of an adopted DeepSpeed launch, else None.

    ``auto_clipping``: what an ``"auto"`` ``gradient_clipping`` becomes: Accelerate's 1.0, or
    None where the front end clips itself (the HF Trainer fills "auto" from ``max_grad_norm``
    and clips with it).
    """
    if os.environ.get(ADOPTED_ENV) != "1":
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none":
        data, source = dict(read_mapping_file(Path(path))), f"the DeepSpeed launch's deepspeed_config_file {path}"
    else:
        data, source = _inline_deepspeed_config(), "the DeepSpeed launch's deepspeed_config keys"
    if is_auto(data.get("gradient_clipping")) and auto_clipping is not None:
        data["gradient_clipping"] = auto_clipping
    return data, source


def _inline_deepspeed_config() -> dict:
    """The ds_config Accelerate's ``DeepSpeedPlugin`` builds from the accelerate config's inline keys."""
    env = os.environ.get
    zero: dict = {"stage": int(env("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))}
    for ours, name in (("offload_optimizer", "OPTIMIZER"), ("offload_param", "PARAM")):
        device = env(f"ACCELERATE_DEEPSPEED_OFFLOAD_{name}_DEVICE", "none").lower()
        zero[ours] = {"device": device}
        nvme = env(f"ACCELERATE_DEEPSPEED_OFFLOAD_{name}_NVME_PATH", "none")
        if device == "nvme" and nvme != "none":
            zero[ours]["nvme_path"] = nvme
    data: dict = {"zero_optimization": zero}
    clipping = env("ACCELERATE_GRADIENT_CLIPPING", "auto")
    data["gradient_clipping"] = clipping if is_auto(clipping) else float(clipping)
    return data


def launched_processes() -> int:
    """How many processes the launcher started (WORLD_SIZE), 1 when not launched."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _has_accelerator_device() -> bool:
    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "is_available"):
        return bool(accel.is_available())
    return torch.cuda.is_available()


def use_cpu_if_no_device(cpu: bool) -> bool:
    """``cpu`` for Accelerator(): True when N > 1 processes were launched on a machine without accelerators."""
    if cpu or launched_processes() <= 1 or "LOCAL_RANK" not in os.environ:
        return cpu
    if _has_accelerator_device():
        return cpu
    if os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() not in ("1", "true", "yes"):
        os.environ["ACCELERATE_USE_CPU"] = "true"
        logger.info("ZeroAccelerator: %d processes launched and no GPU: running them on CPU with gloo "
                    "(ACCELERATE_USE_CPU=true)", launched_processes())
    return True


def check_after_init(accelerator) -> None:
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        raise ValueError("ZeroAccelerator: Accelerate's state was set up for DeepSpeed before the DeepSpeed launch "
                         "could be adopted (a plain Accelerator, TrainingArguments or PartialState was created "
                         "first). Create the ZeroAccelerator first, or `import zero_strategy.transformers` before "
                         "building TrainingArguments; the launch config can stay as it is")
    if kind in (DistributedType.FSDP, DistributedType.MEGATRON_LM):
        raise ValueError(f"ZeroAccelerator: the launch's distributed type is {kind.value}; ZeroAccelerator does the "
                         f"sharding itself, so {RECIPES_HINT}")
    if kind == DistributedType.XLA:
        raise ValueError("ZeroAccelerator does not support TPUs/XLA (torch.distributed collectives on NCCL or gloo "
                         "only)")
    if getattr(accelerator, "is_fsdp2", False):
        raise ValueError(f"ZeroAccelerator: FSDP2 is enabled; {RECIPES_HINT}")
    launched = launched_processes()
    if launched > 1 and accelerator.num_processes != launched:
        raise RuntimeError(
            f"ZeroAccelerator: {launched} processes were launched (WORLD_SIZE={launched}) but Accelerate set this "
            f"one up as {accelerator.num_processes} process(es) ({kind.value}). On a machine without GPUs set "
            "ACCELERATE_USE_CPU=1 for the launch (or TrainingArguments(use_cpu=True) / Accelerator(cpu=True) "
            "before anything else touches Accelerate's state)")
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and any(getattr(pc, f"{k}_enabled", False) for k in ("tp", "cp", "sp")):
        refuse_model_parallel_sizes(pc)  # set some other way than the constructor or the launch: the same refusal
    if str(getattr(accelerator, "fp8_backend", "")).split(".")[-1].upper() not in ("", "NO", "NONE"):
        raise ValueError("ZeroAccelerator: fp8 is not supported; use mixed_precision 'bf16' or 'fp16'")
