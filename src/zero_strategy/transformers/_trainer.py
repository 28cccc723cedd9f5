"""``ZeroTrainer``: the Hugging Face ``Trainer`` running on a ZeroAccelerator.

[Note: what is overridden and why]
* ``create_accelerator_and_postprocess``: the Trainer builds ``Accelerator(**kwargs)``
  from its arguments (mixed precision from ``bf16``/``fp16``, data-loader settings,
  accumulation handled by the Trainer itself). We let it do all of that and only
  change the class it calls, for the duration of the call, to a ZeroAccelerator with
  our ``zero_config``; afterwards we check that a ZeroAccelerator was really built,
  so a change in transformers fails loudly instead of silently training with DDP.
* ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``: the stock
  Trainer saves ``optimizer.state_dict()`` from the main process only, which for a
  sharded optimizer is rank 0's shard. We save every rank's shard (and the fp32
  masters) with :func:`zero_strategy.save_checkpoint` into ``checkpoint-N/zero_checkpoint``
  and load it back re-sharded, so ``train(resume_from_checkpoint=...)`` continues the
  same run, also on another number of processes or another stage.
* ``save_model``: every rank takes part in consolidating the fp32 weights
  (``full_state_dict(rank0_only=True)``); the main process writes them with
  ``save_pretrained``, so ``from_pretrained(checkpoint-N)`` works, also under stage 3.
* ``_load_best_model`` (``load_best_model_at_end``): from the best checkpoint's shards.
* Gradients: the Trainer clears them with ``model.zero_grad()``, which cannot reach
  gradient shards; a callback calls the optimizer's ``zero_grad()`` after each step.
"""

from __future__ import annotations

import os

import torch
import transformers.trainer as hf_trainer
from transformers import Trainer, TrainerCallback

from .. import api
from ..accelerate import ZeroAccelerator
from ..checkpoint import load_checkpoint, load_sharded_weights, safetensors_reader, save_checkpoint

ZERO_CHECKPOINT_DIR = "zero_checkpoint"
SCHEDULER_NAME = "scheduler.pt"


class _ZeroGradAfterStep(TrainerCallback):
    """The Trainer calls ``model.zero_grad()``; gradient shards are cleared by the optimizer."""

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:
            optimizer.zero_grad()


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` with ZeRO sharding (any ``Trainer`` argument, plus ``zero_config``).

    ``zero_config``: preset name, YAML/JSON path (ours or a DeepSpeed ``ds_config``), mapping
    or :class:`~zero_strategy.ZeroConfig`; default ``$ZERO_STRATEGY_CONFIG``, else ``zero2``.
    Precision comes from ``TrainingArguments(bf16=... / fp16=...)``; clipping from
    ``max_grad_norm`` (global norm over all shards). One ``train()`` per ZeroTrainer: to
    resume, build a new one and call ``train(resume_from_checkpoint=...)``.
    """

    def __init__(self, *args, zero_config=None, **kwargs):
        self._zero_config_spec = zero_config
        super().__init__(*args, **kwargs)
        self.add_callback(_ZeroGradAfterStep())

    # ------------------------------------------------------------------ accelerator
    def create_accelerator_and_postprocess(self) -> None:
        spec = self._zero_config_spec
        stock = hf_trainer.Accelerator

        def build(**kwargs):
            return ZeroAccelerator(zero_config=spec, **kwargs)

        hf_trainer.Accelerator = build
        try:
            super().create_accelerator_and_postprocess()
        finally:
            hf_trainer.Accelerator = stock
        if not isinstance(self.accelerator, ZeroAccelerator):
            import transformers

            raise RuntimeError(
                f"ZeroTrainer: transformers {transformers.__version__} no longer builds its Accelerator through "
                "transformers.trainer.Accelerator; ZeroTrainer needs updating for it")

    def _zero_record(self):
        acc = getattr(self, "accelerator", None)
        if not isinstance(acc, ZeroAccelerator):
            return None
        return next((r for r in acc.zero_models if r.model is self.model), None)

    @staticmethod
    def _optimizers(record):
        opts = [o.zero_optimizer for o in record.optimizers]
        return opts[0] if len(opts) == 1 else (opts or None)

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        record = self._zero_record()
        if record is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_checkpoint(os.path.join(output_dir, ZERO_CHECKPOINT_DIR), record.model, self._optimizers(record))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        record = self._zero_record()
        if record is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        ckpt = os.path.join(checkpoint, ZERO_CHECKPOINT_DIR)
        if not os.path.isdir(ckpt):
            raise FileNotFoundError(
                f"ZeroTrainer: {checkpoint} has no {ZERO_CHECKPOINT_DIR}/ (it was not saved by a ZeroTrainer, or "
                "with save_only_model=True); resume needs every rank's optimizer shard")
        load_checkpoint(ckpt, record.model, self._optimizers(record))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Consolidated fp32 weights via ``save_pretrained`` on the main process; every rank must call it."""
        if self._zero_record() is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = api.full_state_dict(self.model, rank0_only=True)
        self._save(output_dir, state_dict=state_dict)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _load_best_model(self) -> None:
        record = self._zero_record()
        if record is None:
            return super()._load_best_model()
        best = self.state.best_model_checkpoint
        ckpt = os.path.join(best, ZERO_CHECKPOINT_DIR)
        if os.path.isdir(ckpt):
            load_checkpoint(ckpt, record.model)  # weights only: training is over
            return
        weights = [f for f in ("model.safetensors", "model.safetensors.index.json")
                   if os.path.isfile(os.path.join(best, f))]
        if not weights:
            raise FileNotFoundError(f"ZeroTrainer: load_best_model_at_end found neither {ckpt} nor safetensors "
                                    f"weights in {best}")
        # a weights-only checkpoint (save_only_model=True): each rank reads only its slices
        load_sharded_weights(record.model, safetensors_reader(best))
