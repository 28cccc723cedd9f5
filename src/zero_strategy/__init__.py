"""zero_strategy: ZeRO sharded data-parallel training for PyTorch.

Stage 1 shards optimizer state across ranks, stage 2 also gradients, stage 3 also
parameters. Pure Python on ``torch.distributed``; see README.md.
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
from .estimate import MemoryEstimate, estimate_memory
from ._memory import MemoryReport
from ._optimizer import ZeroOptimizer
from .api import (
    comm_stats,
    engine_of,
    full_state_dict,
    gathered_parameters,
    memory_report,
    no_sync,
    setup,
    teardown,
)
from . import checkpoint
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint

__version__ = "0.1.0"

__all__ = [
    "CPUOffload", "LossScaleConfig", "NVMeOffload", "PRESETS", "ZeroConfig", "ZeroConfigError",
    "preset_names", "MemoryEstimate", "estimate_memory", "MemoryReport", "ZeroOptimizer",
    "comm_stats", "engine_of", "full_state_dict", "gathered_parameters", "memory_report",
    "no_sync", "setup", "teardown", "__version__",
    "checkpoint", "CheckpointError", "load_checkpoint", "save_checkpoint",
]


def __getattr__(name: str):
    """``zero_strategy.ZeroAccelerator``, imported on first use so ``import zero_strategy`` never imports Accelerate."""
    if name == "ZeroAccelerator":
        from .accelerate import ZeroAccelerator

        return ZeroAccelerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
