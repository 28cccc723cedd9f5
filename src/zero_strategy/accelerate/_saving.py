"""``ZeroAccelerator.save_model`` of a stage-3 model, written unit by unit.

[Note: streamed save_model]
Stock ``Accelerator.save_model`` starts from ``get_state_dict(model)``, which here is
``full_state_dict(model, rank0_only=True)``: the main process holds the whole model's
fp32 weights on the host before the first byte is written. At stage 3 the same files are
written from one unit at a time instead (the machinery of ``save_pretrained``'s streamed
save: See [Note: streamed save_pretrained] in _model/hf.py): the device holds
one group beyond its shards, the main process one unit's host copies, the others nothing.

What is written is what stock ``save_model`` writes from ``get_state_dict``:

* the names of ``model.state_dict()``, less the later names of a tensor that appears
  twice (tied weights), as ``clean_state_dict_for_safetensors`` drops them (it keeps the
  first name in state-dict order);
* each floating tensor in fp32 (the masters where a group trains), the others as stored,
  as ``full_state_dict`` gives them;
* the files ``huggingface_hub.split_torch_state_dict_into_shards`` plans for
  ``max_shard_size`` over that state dict in its own order: ``model.safetensors``, or
  ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``
  (``{"metadata": {"total_size"}, "weight_map"}``), with ``{"format": "pt"}`` in each
  header; the plan is made from meta tensors of the same shapes and dtypes, so it is the
  library's own. Within a file the tensors are laid out in the order they arrive (unit by
  unit), which readers do not depend on (safetensors indexes by name);
* no older file removed: stock ``save_model``'s clean-up looks for names starting with
  ``model.safetensors`` and ending in ``-0000i-of-0000N``, which no safetensors shard has,
  so with ``safe_serialization=True`` it removes nothing, and neither does this.

Stock ``save_model`` runs unchanged where streaming would change the result: below stage 3
(nothing is sharded: the weights are whole on every rank), ``safe_serialization=False``
(``torch.save`` of one pickled dict needs every tensor at once), a model with Accelerate's
offload hooks (stock reads those through ``get_state_dict_offloaded_model``), and a state
dict holding something other than tensors.
"""

from __future__ import annotations

import json
import os

import torch
from accelerate.logging import get_logger
from accelerate.utils.constants import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_PATTERN_NAME
from accelerate.utils.modeling import has_offloaded_params
from torch import nn

from .. import api

logger = get_logger(__name__)


def streams(model: nn.Module, safe_serialization: bool) -> bool:
    """Whether ``save_model`` of a set-up ``model`` is written unit by unit. See [Note: streamed save_model]."""
    if not safe_serialization or not api.engine_of(model).shards_parameters:
        return False
    if any(has_offloaded_params(m) for m in model.modules()):
        return False
    return all(isinstance(t, torch.Tensor) for t in model.state_dict(keep_vars=True).values())


def save_model_streamed(accelerator, model: nn.Module, save_directory, max_shard_size) -> None:
    """Stock ``Accelerator.save_model(model, save_directory, max_shard_size, safe_serialization=True)``
    of a stage-3 model, one unit at a time; every process calls it. See [Note: streamed save_model]."""
    from huggingface_hub import split_torch_state_dict_into_shards

    if os.path.isfile(save_directory):
        logger.error(f"Provided path ({save_directory}) should be a directory, not a file")
        return
    if any(p.device == torch.device("meta") for p in model.parameters()):
        raise RuntimeError("You can't save the model since some parameters are on the meta device.")
    entries = _entries(model)
    shapes = {id(p): shape for p, shape in api.full_shapes(model).items()}  # a stage-3 parameter is empty
    meta = {n: torch.empty(shapes.get(id(t), t.shape), dtype=torch.float32 if t.is_floating_point() else t.dtype,
                           device="meta") for n, t in entries.items()}
    split = split_torch_state_dict_into_shards(meta, filename_pattern=SAFE_WEIGHTS_PATTERN_NAME,
                                               max_shard_size=max_shard_size)
    del meta
    main = accelerator.is_main_process
    os.makedirs(save_directory, exist_ok=True)
    api.write_safetensors(model, save_directory, split.tensor_to_filename, list(split.filename_to_tensors),
                          write=main, dtype=torch.float32)
    if main and split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        with open(os.path.join(save_directory, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict(keep_vars=True)`` (names, no gather) less the later names of a tensor
    already named, as ``clean_state_dict_for_safetensors`` leaves ``get_state_dict``'s result."""
    named = model.state_dict(keep_vars=True)
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = t
    if len(out) < len(named):
        logger.warning(f"Removed shared tensor {set(named) - set(out)} while saving. This should be OK, but check by "
                       "verifying that you don't receive any warning while reloading")
    return out
