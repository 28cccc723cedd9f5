"""``ZeroTrainer``: the Hugging Face ``Trainer`` running on a ZeroAccelerator.

The overrides live in :class:`~zero_strategy.transformers._mixin.ZeroTrainerMixin` (see its
[Note: what is overridden and why]), so that any ``Trainer`` subclass (TRL's
``SFTTrainer``, ``DPOTrainer``, a user's own) gets them through ``zero_trainer(cls)``;
``ZeroTrainer`` is that mixin on the stock ``Trainer`` (through the floor that keeps the
stock optimizer checkpoint away from ZeRO models: See [Note: the subclass's checkpoint
overrides] there).
"""

from __future__ import annotations

from transformers import Trainer

from ._mixin import SCHEDULER_NAME, ZERO_CHECKPOINT_DIR, ZeroTrainerMixin, _register, _StockCheckpointFloor

__all__ = ["ZeroTrainer", "ZERO_CHECKPOINT_DIR", "SCHEDULER_NAME"]


class ZeroTrainer(ZeroTrainerMixin, _StockCheckpointFloor):
    """``transformers.Trainer`` with ZeRO sharding (any ``Trainer`` argument, plus ``zero_config``).

    ``zero_config``: preset name, YAML/JSON path (ours or a DeepSpeed ``ds_config``), mapping
    or :class:`~zero_strategy.ZeroConfig`; default ``$ZERO_STRATEGY_CONFIG``, else a DEEPSPEED launch's
    ds_config, else ``zero3``.
    Precision comes from ``TrainingArguments(bf16=... / fp16=...)``; clipping from
    ``max_grad_norm`` (global norm over all shards). One ``train()`` per ZeroTrainer: to
    resume, build a new one and call ``train(resume_from_checkpoint=...)``.
    """


_register(Trainer, ZeroTrainer)
