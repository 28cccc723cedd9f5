"""Sharded checkpoints: save on N ranks, load on any number of ranks and any stage, consolidate.

``save_checkpoint(path, model, optimizer, extra_state)`` writes a directory with one
safetensors file per rank (its master/frozen shards and elementwise optimizer
state), ``buffers.safetensors`` and ``metadata.json`` (format version, per-parameter
layout by fully qualified name, optimizer class, hyperparameters and scalar state,
loss scale, per-file xxh3_128 digests). ``load_checkpoint`` re-shards by name onto the running
world size and stage; ``consolidate`` streams a full state dict out in one process.
``load_checkpoint`` also reads a DeepSpeed ZeRO checkpoint (``_deepspeed.py``), DeepSpeed's universal
checkpoint (``_deepspeed_universal.py``) and a torch.distributed.checkpoint directory of an
FSDP2/torchtitan run (``_dcp.py``) the same way; ``export_checkpoint`` writes ours as DCP or as a
DeepSpeed universal checkpoint.
See ``_layout.py`` for the on-disk layout and ``_save.py`` for atomic replacement.

[Note: why not torch.distributed.checkpoint]
DCP would give us planning and storage writers, but not what this feature is for:
it has no per-file checksums (we refuse truncated/corrupted shards by name), no
atomic replacement of a previous checkpoint directory, and resharding our flat,
padded 1-D shards across stages and world sizes would need each shard wrapped as a
DTensor/ShardedTensor with a per-parameter view that does not exist in the flat
buffer (a parameter can span shards; a shard holds several parameters). Its
consolidation (``dcp_to_torch_save``) loads the whole model into memory. Our
layout is a small JSON table plus plain safetensors files that any tool can read,
and both re-sharding and streaming consolidation are a few lines over it.
"""

from . import _dcp_load  # noqa: F401 - registers the DCP reader with load_checkpoint
from . import _deepspeed_load  # noqa: F401 - registers the DeepSpeed reader, after DCP's
from ._consolidate import consolidate, parse_size
from ._dcp_save import export_checkpoint, save_dcp
from ._deepspeed import deepspeed_lr_scheduler_state
from ._layout import FORMAT_VERSION, CheckpointError
from ._load import load_checkpoint, load_metadata
from ._save import save_checkpoint, wait_for_save
from ._sharded_weights import load_full_state_dict, load_sharded_weights, safetensors_reader

__all__ = ["save_checkpoint", "wait_for_save", "load_checkpoint", "consolidate", "export_checkpoint", "save_dcp",
           "CheckpointError", "FORMAT_VERSION",
           "load_metadata", "parse_size", "load_sharded_weights", "safetensors_reader",
           "load_full_state_dict", "deepspeed_lr_scheduler_state"]
