"""zero_strategy: ZeRO sharded data-parallel training for PyTorch.

Stage 1 shards optimizer state across ranks, stage 2 also gradients, stage 3 also
parameters. Pure Python on ``torch.distributed``; see README.md and the guides in docs/.
"""

from .config import (
    CPUOffload,
    LossScaleConfig,
    NVMeOffload,
    PRESETS,
    ZeroConfig,
    ZeroConfigError,
    preset_names,
)
from ._comm.collectives import CollectiveDesync, CollectiveError, CollectiveTimeout
from .estimate import MemoryEstimate, estimate_memory
from ._model.memory import MemoryReport
from ._optim.optimizer import OverlapStepCommitted, ZeroOptimizer
from ._zero_auto import AvailableMemory
from .api import (
    choose_preset,
    comm_stats,
    engine_of,
    full_shapes,
    full_state_dict,
    gather_once_in_generate,
    gathered_for_generation,
    gathered_parameters,
    is_set_up,
    memory_report,
    no_sync,
    offload_states,
    offloaded_checkpoint,
    reload_states,
    reset_iter_state,
    sequence_parallel_group,
    sequence_parallel_loader,
    sequence_parallel_loss,
    setup,
    shard_sequence,
    states_offloaded,
    states_offloaded_for_generation,
    teardown,
    tiled_causal_lm_loss,
    zero_grad,
)
from . import checkpoint
from .checkpoint import CheckpointError, load_checkpoint, load_full_state_dict, save_checkpoint

from ._version import __version__

__all__ = [
    "CollectiveDesync", "CollectiveError", "CollectiveTimeout", "CPUOffload", "LossScaleConfig", "NVMeOffload", "PRESETS", "ZeroConfig", "ZeroConfigError",
    "preset_names", "MemoryEstimate", "estimate_memory", "MemoryReport", "ZeroOptimizer",
    "OverlapStepCommitted",
    "AvailableMemory", "choose_preset", "comm_stats", "engine_of", "full_shapes", "full_state_dict",
    "gather_once_in_generate", "gathered_for_generation", "gathered_parameters", "is_set_up", "memory_report",
    "no_sync", "offload_states", "offloaded_checkpoint", "reload_states", "states_offloaded", "states_offloaded_for_generation",
    "reset_iter_state", "setup", "teardown", "tiled_causal_lm_loss", "shard_sequence", "sequence_parallel_loss",
    "sequence_parallel_loader", "sequence_parallel_group", "zero_grad", "__version__",
    "checkpoint", "CheckpointError", "load_checkpoint", "load_full_state_dict", "save_checkpoint",
]


# --- Lightning front end (zero_strategy.lightning): registration and lazy classes ---------
# Registers the presets in Lightning's strategy registries now if Lightning is imported,
# else right after Lightning creates them; never imports Lightning (several seconds).
from .lightning._registry import register_if_available as _register_lightning  # noqa: E402

_register_lightning()

_LIGHTNING_ATTRS = {"ZeroStrategy", "ZeroFabricStrategy"}


def __getattr__(name: str):
    """``ZeroStrategy``, ``ZeroFabricStrategy``, ``ZeroAccelerator``: imported on first use, so
    ``import zero_strategy`` never imports Lightning or Accelerate."""
    if name in _LIGHTNING_ATTRS:
        from . import lightning

        return getattr(lightning, name)
    if name == "ZeroAccelerator":  # Accelerate front end, imported on first use (never by `import zero_strategy`)
        from .accelerate import ZeroAccelerator

        return ZeroAccelerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
