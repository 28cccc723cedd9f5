"""What each ``"auto"`` value of a DeepSpeed ``ds_config`` becomes: one resolver for every front end.

[Note: "auto" means "the front end supplies it"]
DeepSpeed itself refuses ``"auto"``; the Hugging Face integrations fill each one from
the training arguments before DeepSpeed starts. Here every front end (Lightning's
Trainer and Fabric strategies, ZeroAccelerator, the HF Trainer, and the plain
``ZeroConfig.from_deepspeed``) goes through :func:`resolve_auto`, so one ``ds_config``
means the same thing wherever it is used. Each ``"auto"`` key falls in one class:

* **front-end precision** (``fp16.enabled``, ``bf16.enabled``, ``bfloat16.enabled``):
  the translation leaves ``precision`` unset (``"fp32"``, which every front end reads
  as "not specified") and the front end's own precision setting (Lightning's
  ``precision=``, Accelerate's ``mixed_precision``, ``TrainingArguments(bf16=...)``)
  is applied on top, by that front end's precision rule. The ``fp16`` section's
  loss-scale keys are still read, for the case that the front end picks fp16.
* **front-end clipping** (``gradient_clipping``): the engine does not clip inside
  ``step()``; the front end's own clipping call (``gradient_clip_val``,
  ``accelerator.clip_grad_norm_``, ``max_grad_norm``) clips by the global norm.
* **front-end loop** (batch sizes, ``gradient_accumulation_steps``): the loop's
  setting (data loader, ``accumulate_grad_batches``, ``gradient_accumulation_steps``)
  is used; the engine never reads these keys.
* **default** (``stage3_param_persistence_threshold``, ``communication_data_type``):
  the ZeroConfig default, which is DeepSpeed's own default (1e5 elements; reduce in
  the compute dtype). The HF Trainer would use ``10 * hidden_size`` for the first; a
  value that depends on the model cannot be known when the config is read, and the
  threshold changes memory and traffic only, never the numbers trained.
* **no effect** (bucket sizes, ``stage3_max_live_parameters``, ...): tuning knobs this
  engine sizes itself; ``"auto"`` is as good as any value.

Any other ``"auto"`` (``zero_optimization.stage``, offload devices, loss-scale values)
has no value to take and stays an error naming the key.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTO_RULES", "ResolvedAuto", "resolve_auto", "is_auto"]

FRONT_END_PRECISION = "the front end's precision setting"
FRONT_END_CLIPPING = "the front end's clipping (not clipped inside step())"
FRONT_END_LOOP = "the training loop's own setting"
DEFAULT = "the ZeroConfig default (DeepSpeed's default)"
NO_EFFECT = "no effect (sized by the engine)"

#: dotted ds_config key -> what "auto" there becomes (see the module note)
AUTO_RULES: dict[str, str] = {
    "fp16.enabled": FRONT_END_PRECISION,
    "bf16.enabled": FRONT_END_PRECISION,
    "bfloat16.enabled": FRONT_END_PRECISION,
    "gradient_clipping": FRONT_END_CLIPPING,
    "train_batch_size": FRONT_END_LOOP,
    "train_micro_batch_size_per_gpu": FRONT_END_LOOP,
    "gradient_accumulation_steps": FRONT_END_LOOP,
    "zero_optimization.stage3_param_persistence_threshold": DEFAULT,
    "zero_optimization.param_persistence_threshold": DEFAULT,
    "communication_data_type": DEFAULT,
    **{f"zero_optimization.{k}": NO_EFFECT for k in (
        "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
        "stage3_max_live_parameters", "max_live_parameters", "stage3_max_reuse_distance", "max_reuse_distance",
        "sub_group_size", "stage3_model_persistence_threshold", "model_persistence_threshold",
        "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "gather_16bit_weights_on_model_save", "overlap_comm", "contiguous_gradients", "round_robin_gradients",
        "reduce_scatter", "allgather_partitions")},
}


@dataclass(frozen=True)
class ResolvedAuto:
    """``data``: the ds_config with every resolvable ``"auto"`` removed (so the translator
    sees "absent", i.e. the default); ``precision_from_front_end``: the sections whose
    ``enabled`` was ``"auto"``; ``resolved``: dotted key -> what it became."""

    data: dict
    precision_from_front_end: tuple[str, ...]
    resolved: dict[str, str]


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def resolve_auto(data: Mapping) -> ResolvedAuto:
    """Resolve the ``"auto"`` values of ``data`` by :data:`AUTO_RULES`; ``data`` is not changed."""
    out = copy.deepcopy(dict(data))
    resolved: dict[str, str] = {}
    from_front_end: list[str] = []
    for key, rule in AUTO_RULES.items():
        parent, name = _parent(out, key)
        if parent is None or not is_auto(parent.get(name)):
            continue
        del parent[name]
        resolved[key] = rule
        if rule is FRONT_END_PRECISION:
            from_front_end.append(key.split(".")[0])
    return ResolvedAuto(out, tuple(from_front_end), resolved)


def _parent(data: dict, dotted: str) -> tuple[dict | None, str]:
    *path, name = dotted.split(".")
    node: Any = data
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None, name
    return node, name
