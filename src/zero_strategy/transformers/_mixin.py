"""``ZeroTrainerMixin`` and ``zero_trainer(cls)``: any Hugging Face ``Trainer`` subclass on ZeRO.

::

    from trl import DPOTrainer, SFTTrainer
    from zero_strategy.transformers import zero_trainer

    trainer = zero_trainer(SFTTrainer)(model=model, args=SFTConfig(...), train_dataset=ds, zero_config="zero3")

TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ...) and most user trainers are ``Trainer``
subclasses that add a loss, a data collator or a reference model and leave the
accelerator, checkpointing and saving to ``Trainer``. Those are exactly the places
ZeRO changes, so one mixin placed first in the MRO serves all of them; ``zero_trainer``
builds that subclass, once per class.

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
  same run, also on another number of processes or another stage. The subclass's own
  overrides still run (See [Note: the subclass's checkpoint overrides]).
* ``compute_loss`` under sequence parallelism; See [Note: sequence parallelism under the Trainer].
* ``generate()``: every generate of the trainer's models gathers the units once
  (the accelerator calls ``zero_strategy.gather_once_in_generate`` on each model it
  sets up, the policy when ``train()`` prepares it), unless the arguments say
  ``ds3_gather_for_generation=False``, TRL's switch for DeepSpeed ZeRO-3, which then
  means per-unit gathering here as there. TRL's trainers (GRPO, RLOO, online DPO, GKD,
  distillation, the completion-logging callbacks) all generate through ``model.generate``
  inside ``unwrap_model_for_generation``, whose DeepSpeed gather does not apply to us;
  nothing of TRL is patched.

[Note: the subclass's checkpoint overrides]
``zero_trainer(Name)`` builds ``Zero<Name>(ZeroTrainerMixin, Name, _StockCheckpointFloor)``,
whose MRO is ``Zero<Name>, ZeroTrainerMixin, Name, ..., _StockCheckpointFloor, Trainer``:
the floor sits right above ``transformers.Trainer``. The mixin saves / loads the ZeRO
record and then calls ``super()``, so ``Name``'s own overrides run (GRPOTrainer restores
``entropy_ctrl_state.json`` in ``_load_optimizer_and_scheduler``); when their ``super()``
calls reach the floor, it stops them on a ZeRO model, because the stock implementation
would save or load rank 0's shard as ``optimizer.pt``. A class written by hand as
``(ZeroTrainerMixin, Name)`` without the floor keeps the old behaviour: its overrides
of these two methods are not called on a ZeRO model.
* ``save_model``: every rank takes part in consolidating the fp32 weights; the main
  process writes them with ``save_pretrained``, so ``from_pretrained(checkpoint-N)`` works,
  also under stage 3. There a transformers model's weights are streamed unit by unit
  (``save_pretrained(..., dtype=torch.float32)``, See [Note: streamed save_pretrained] in
  _model/hf.py), so no rank holds the whole model. A PEFT model (or one with
  adapters loaded) is given to the stock ``_save`` with a state dict of the entries its
  adapter save keeps (``api.adapter_state_dict``: only the units holding the adapter are
  gathered, at every stage; See [Note: streamed adapter saves]), so it writes what the stock
  Trainer writes (``adapter_model.safetensors``, ``adapter_config.json``, the tokenizer,
  ``training_args.bin``). Other models go through ``full_state_dict(rank0_only=True)``.
* ``_load_best_model`` (``load_best_model_at_end``): from the best checkpoint's shards.
* ``_load_from_checkpoint`` and ``_load_optimizer_and_scheduler`` on a ``checkpoint-N`` that the
  Trainer wrote with DeepSpeed (See [Note: a DeepSpeed run's checkpoint-N]).

[Note: a DeepSpeed run's checkpoint-N]
The Trainer with DeepSpeed writes ``checkpoint-N/`` holding DeepSpeed's own checkpoint
(``engine.save_checkpoint(checkpoint-N)``: ``latest`` and ``global_stepN/``, the fp32 masters and
the optimizer's state per rank), its ``scheduler.pt`` (unless DeepSpeed's config had its own
scheduler, which DeepSpeed then saves inside its checkpoint), ``trainer_state.json`` and the RNG
states; model weights only at stages 1-2 or with ``stage3_gather_16bit_weights_on_model_save``,
and in 16 bits. ``train(resume_from_checkpoint=checkpoint-N)`` takes the exact fp32 weights and
the optimizer state from DeepSpeed's checkpoint with :func:`zero_strategy.load_checkpoint` (so the
stock weight load, which would want a weights file, is skipped), the scheduler from
``scheduler.pt`` or else from DeepSpeed's checkpoint (another scheduler class there is refused),
and the trainer state and RNG states as the stock Trainer does.
* The end of ``train()`` waits for an asynchronous checkpoint save (``async_save``) still writing,
  through a callback's ``on_train_end``, and raises its failure.
* ``_save_checkpoint``: the rotation of old ``checkpoint-N`` (``save_total_limit``) waits for the
  commit of an asynchronous save; See [Note: rotation after the commit].

[Note: rotation after the commit]
The stock ``_save_checkpoint`` deletes the oldest ``checkpoint-N`` beyond ``save_total_limit`` right
after the save returns (``rotate_checkpoints``; ``Trainer._rotate_checkpoints`` before transformers
5). An asynchronous save has returned before its shards are written: deleting then, a write that
fails (a full disk, a kill) would leave fewer good checkpoints than the limit promised, none with
``save_total_limit=1``. So while the save is writing, the rotation is only noted; once the save
commits (``EngineView.after_save_succeeds``), it is due, and the training thread runs the stock
rotation unchanged at the next point where the committed checkpoint is the newest on disk: the
start of the next ``_save_checkpoint`` (before it creates ``checkpoint-N+1``) and the end of
``train()``. It is not run on the saving thread: the stock rotation keeps the newest directory it
finds, which by then may be the next, still unwritten, checkpoint. A failed save never makes its
rotation due, so every older checkpoint stays. A synchronous save rotates at once, as stock.
* Gradients: the Trainer clears them with ``model.zero_grad()``, which cannot reach
  gradient shards; a callback calls the optimizer's ``zero_grad()`` after each step.

[Note: models that only run forward]
Subclasses prepare their extra models in ``__init__`` with
``accelerator.prepare_model(m, evaluation_mode=True)`` (TRL: DPO/KTO/GRPO/RLOO's
``ref_model``, the distillation ``teacher_model``). Under DeepSpeed ZeRO-3 TRL shards
them (``trl.models.prepare_deepspeed``); here, after the subclass's ``__init__``, every
model the accelerator holds besides ``self.model`` goes through
``ZeroAccelerator.prepare_frozen_model``, which shards it at stage 3 (parameters only:
no gradients, masters or optimizer state) and leaves it replicated at stages 1-2.
``sync_ref_model`` writes into the reference weights in place, which a sharded model
refuses, so it is refused up front at stage 3 rather than failing mid-run.
"""

from __future__ import annotations

import os
import weakref

import torch
import transformers.trainer as hf_trainer
from transformers import Trainer, TrainerCallback

from .. import api
from .._engine.plan import plan_for
from ..accelerate import ZeroAccelerator
from ..checkpoint import load_checkpoint, load_sharded_weights, safetensors_reader, save_checkpoint, wait_for_save
from ._vllm_sync import adopt_vllm_weight_sync, weight_push_overrides

ZERO_CHECKPOINT_DIR = "zero_checkpoint"
SCHEDULER_NAME = "scheduler.pt"

MIGRATION = ('move it to the trainer: zero_trainer(Trainer)(..., args=TrainingArguments(...), '
             'zero_config="ds_config.json") (the ZeRO section of a DeepSpeed config is read as is)')


class _ZeroGradAfterStep(TrainerCallback):
    """The Trainer calls ``model.zero_grad()``; gradient shards are cleared by the optimizer.

    At the end of training it waits for an asynchronous checkpoint save still writing
    (``async_save`` in the config), raising its failure, as Lightning's ``fit`` does, and then
    rotates old checkpoints as that save's commit allows (See [Note: rotation after the commit]).
    """

    def __init__(self, trainer=None):
        self._trainer = weakref.ref(trainer) if trainer is not None else lambda: None

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:
            optimizer.zero_grad()

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if model is not None and api.is_set_up(model):
            wait_for_save(model)
            trainer = self._trainer()
            if trainer is not None:
                trainer._rotate_committed()


class _TrainerZeroAccelerator(ZeroAccelerator):
    """The Trainer's ZeroAccelerator: a DEEPSPEED launch's ds_config is read as the HF Trainer's
    DeepSpeed integration reads it ("auto" clipping is ``max_grad_norm``, which the Trainer
    applies; a numeric accumulation must equal ``TrainingArguments.gradient_accumulation_steps``)."""

    deepspeed_auto_gradient_clipping = None
    deepspeed_accumulation_wins = False

    @property
    def parallelism_config(self):
        """What the Trainer sees. Under sequence parallelism: None (See [Note: sequence parallelism
        under the Trainer]); the mesh and the loaders still do sequence parallelism."""
        if getattr(self, "sequence_parallel", None) is not None and self.sequence_parallel.size > 1:
            return None
        return self.state.parallelism_config


# [Note: sequence parallelism under the Trainer]
# ``TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N))``
# reaches the ZeroAccelerator, which does sequence parallelism (See [Note: sequence parallelism
# under Accelerate] in accelerate/_accelerator.py): its prepared train loader is sampled over
# the data-parallel ranks and yields each rank's shard, so one epoch is as many steps as its
# ``len``. The Trainer's own DeepSpeed-SP branches assume DeepSpeed's adapter (a loader N times
# longer than the one it prepared), a DeepSpeed plugin and DeepSpeed's process groups, and
# compute a loss whose gradient is only this rank's share (DeepSpeed >= 0.20.2 sums gradients
# over the SP group). So the Trainer is shown no ParallelismConfig (it trains as data
# parallelism over what the loader gives, and counts its batch size over world / N), and
# ``compute_loss`` computes the whole sample's loss on every rank with
# ``zero_strategy.sequence_parallel_loss``, whose gradient convention the engine's average
# expects; the logged loss is the one the stock Trainer logs for one process on whole sequences.
# ``prediction_step`` returns that loss for evaluation and no logits (each rank holds a shard).


#: Trainer subclasses whose training loss under sequence parallelism is the model's own (TRL's SFT
#: calls the stock loss under DeepSpeed's: ``sft_trainer.py``, "Ulysses sequence parallelism reduces
#: the model's own loss across ranks"); See [Note: sequence parallelism under the Trainer]
_SP_LOSS_OF_THE_MODEL = ("trl.trainer.sft_trainer.SFTTrainer",)


class ZeroTrainerMixin:
    """Put first in the bases of a ``transformers.Trainer`` subclass to train it with ZeRO.

    Adds one keyword, ``zero_config``: preset name, YAML/JSON path (ours or a DeepSpeed
    ``ds_config``), mapping or :class:`~zero_strategy.ZeroConfig`; default
    ``$ZERO_STRATEGY_CONFIG``, else a DEEPSPEED launch's
    ds_config, else ``zero3``. Precision comes from
    ``TrainingArguments(bf16=... / fp16=...)``; clipping from ``max_grad_norm`` (global norm
    over all shards). One ``train()`` per trainer: to resume, build a new one and call
    ``train(resume_from_checkpoint=...)``. Usually built with :func:`zero_trainer`.
    """

    def __init__(self, *args, zero_config=None, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "deepspeed", None):
            raise ValueError(f"{type(self).__name__}: TrainingArguments(deepspeed=...) starts DeepSpeed itself; "
                             + MIGRATION)
        self._zero_config_spec = zero_config
        #: the stock rotation of old checkpoints, once the save it follows has committed: See
        #: [Note: rotation after the commit]
        self._rotation_due = None
        super().__init__(*args, **kwargs)
        self._refuse_unsplittable_training()
        self.add_callback(_ZeroGradAfterStep(self))
        self._prepare_frozen_models()
        adopt_vllm_weight_sync(self)  # See [Note: weight sync to vLLM at stage 3] in _vllm_sync.py

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The stock loss, except in training under sequence parallelism: See [Note: sequence
        parallelism under the Trainer]."""
        if not self._sequence_parallel_batch(inputs):
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        inputs = dict(inputs)
        shift_labels = inputs.pop("shift_labels")
        outputs = model(**inputs)
        unwrapped = self.accelerator.unwrap_model(model)
        loss = unwrapped.loss_function(logits=outputs.logits, labels=None, shift_labels=shift_labels,
                                       vocab_size=unwrapped.config.get_text_config().vocab_size)
        loss = api.sequence_parallel_loss(loss, shift_labels, unwrapped)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The stock step, except under sequence parallelism: the whole sample's loss (the eval loader
        is sharded too); the logits are this rank's shard of the sequence, so none are returned."""
        if not self._sequence_parallel_batch(inputs):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """The stock skip, through the accelerator: under sequence parallelism the loader after the
        skip still yields each rank's shard (See [Note: sequence parallelism under the Trainer])."""
        sp = getattr(self.accelerator, "sequence_parallel", None)
        if sp is not None and sp.size > 1:
            return self.accelerator.skip_first_batches(dataloader, num_batches)
        return super().get_resumed_dataloader(dataloader, num_batches)

    def _refuse_unsplittable_training(self) -> None:
        """What sequence parallelism cannot honour, refused at construction naming the fix, never trained
        as something else (See [Note: sequence parallelism under the Trainer])."""
        sp = getattr(getattr(self, "accelerator", None), "sequence_parallel", None)
        if sp is None or sp.size == 1:
            return
        name, args = type(self).__name__, self.args
        if getattr(args, "packing", False) or getattr(args, "padding_free", False):
            raise ValueError(f"{name}: packing and padding_free put several sequences in one row, which sequence "
                             f"parallelism (sp_size={sp.size}) cannot split: its attention is causal over the whole "
                             "row. Pass packing=False and padding_free=False (one sequence per row, padded at the "
                             "end), or sp_size=1")
        own = next(c for c in type(self).__mro__ if "compute_loss" in vars(c) and c is not ZeroTrainerMixin)
        if own is not Trainer and f"{own.__module__}.{own.__qualname__}" not in _SP_LOSS_OF_THE_MODEL:
            raise ValueError(f"{name}: {own.__qualname__} computes a loss of its own, which sequence parallelism "
                             f"(sp_size={sp.size}) would replace by the model's cross-entropy over each whole "
                             "sample; it is not supported. Use sp_size=1, or a Trainer whose loss is the model's "
                             "(transformers.Trainer, trl.SFTTrainer)")
        if (self.compute_loss_func is not None or getattr(self, "label_smoother", None) is not None
                or getattr(args, "loss_type", "nll") not in ("nll", "chunked_nll")):
            raise ValueError(f"{name}: under sequence parallelism (sp_size={sp.size}) the loss is the model's own "
                             "token-mean cross-entropy over each whole sample; compute_loss_func, label_smoothing_factor "
                             "and loss_type other than 'nll' are not supported. Drop them, or use sp_size=1")

    def _sequence_parallel_batch(self, inputs) -> bool:
        sp = getattr(getattr(self, "accelerator", None), "sequence_parallel", None)
        return sp is not None and sp.size > 1 and "shift_labels" in inputs

    def get_total_train_batch_size(self, args) -> int:
        """The stock count over the data-parallel ranks: under sequence parallelism the N ranks of a
        group share their samples."""
        sp = getattr(getattr(self, "accelerator", None), "sequence_parallel", None)
        return super().get_total_train_batch_size(args) // (sp.size if sp is not None else 1)

    def _move_model_to_device(self, model, device) -> None:
        """A model whose parameters are on the meta device (``from_pretrained`` of this package,
        or built under ``torch.device("meta")``) is materialized on the device, sharded, when
        it is prepared: moving it now would fail ("Cannot copy out of meta tensor")."""
        if any(p.is_meta for p in model.parameters()):
            return
        super()._move_model_to_device(model, device)

    # ------------------------------------------------------------------ accelerator
    def create_accelerator_and_postprocess(self) -> None:
        spec = self._zero_config_spec
        stock = hf_trainer.Accelerator

        def build(**kwargs):
            return _TrainerZeroAccelerator(zero_config=spec, **kwargs)

        hf_trainer.Accelerator = build
        try:
            super().create_accelerator_and_postprocess()
        finally:
            hf_trainer.Accelerator = stock
        if isinstance(self.accelerator, ZeroAccelerator):  # See [Note: what is overridden and why] (generate)
            once = getattr(self.args, "ds3_gather_for_generation", True) is not False
            self.accelerator.gather_once_in_generate = once
        else:
            import transformers

            raise RuntimeError(
                f"{type(self).__name__}: transformers {transformers.__version__} no longer builds its Accelerator "
                "through transformers.trainer.Accelerator; ZeroTrainerMixin needs updating for it")

    def _prepare_frozen_models(self) -> None:
        """See [Note: models that only run forward]."""
        acc = self.accelerator
        stage3 = plan_for(acc.zero_config.stage).shards_parameters
        if stage3 and getattr(self.args, "sync_ref_model", False):
            raise NotImplementedError(
                f"{type(self).__name__}: sync_ref_model=True writes into the reference model's weights in place, "
                "which are sharded at stage 3; use stage 1 or 2, or sync_ref_model=False")
        for model in list(acc._models):
            if model is self.model or acc.is_zero_model(model) or not isinstance(model, torch.nn.Module):
                continue
            frozen = acc.prepare_frozen_model(model)
            assert frozen is model  # sharded in place: the subclass's attribute still names it

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
        self._subclass_checkpoint_chain("_save_optimizer_and_scheduler", output_dir)

    def _save_checkpoint(self, model, trial, *args, **kwargs) -> None:
        """The stock save, whose rotation of old checkpoints waits for this save's commit: See
        [Note: rotation after the commit]. (``*args``: transformers < 4.48 passes ``metrics`` too.)"""
        if self._zero_record() is None:
            return super()._save_checkpoint(model, trial, *args, **kwargs)
        self._rotate_committed()  # the previous save's, due since it committed
        stock = getattr(hf_trainer, "rotate_checkpoints", None)
        if stock is None:  # transformers < 5 rotates in the method _rotate_checkpoints, overridden below
            return super()._save_checkpoint(model, trial, *args, **kwargs)
        hf_trainer.rotate_checkpoints = lambda **rotation: self._rotate_after_commit(lambda: stock(**rotation))
        try:
            super()._save_checkpoint(model, trial, *args, **kwargs)
        finally:
            hf_trainer.rotate_checkpoints = stock

    def _rotate_checkpoints(self, use_mtime: bool = False, output_dir: str | None = None) -> None:
        """transformers < 5: See [Note: rotation after the commit]."""
        stock = super()._rotate_checkpoints
        self._rotate_after_commit(lambda: stock(use_mtime=use_mtime, output_dir=output_dir))

    def _rotate_after_commit(self, rotate) -> None:
        """``rotate`` now when no asynchronous save is writing, else once it has committed."""
        self._rotation_due = None  # the previous save's: this rotation does all it would, and more
        record = self._zero_record()
        if record is None or not api.engine_of(record.model).after_save_succeeds(
                lambda: setattr(self, "_rotation_due", rotate)):
            rotate()

    def _rotate_committed(self) -> None:
        """Run the rotation a committed save made due (See [Note: rotation after the commit])."""
        rotate = self._rotation_due
        if rotate is not None:  # set by the saving thread, which sets it once per save
            self._rotation_due = None
            rotate()

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        record = self._zero_record()
        if record is None or checkpoint is None:  # with a record, the floor stops the stock load
            return super()._load_optimizer_and_scheduler(checkpoint)
        ckpt = os.path.join(checkpoint, ZERO_CHECKPOINT_DIR)
        deepspeed = not os.path.isdir(ckpt) and _is_deepspeed_run(checkpoint)
        if deepspeed:  # See [Note: a DeepSpeed run's checkpoint-N]
            ckpt = checkpoint
        elif not os.path.isdir(ckpt):
            raise FileNotFoundError(
                f"{type(self).__name__}: {checkpoint} has no {ZERO_CHECKPOINT_DIR}/ (it was not saved by a ZeRO "
                "trainer, or with save_only_model=True) nor a DeepSpeed checkpoint; resume needs every rank's "
                "optimizer shard")
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        # read before the shards are loaded: a scheduler file torch.load refuses changes nothing
        scheduler_state = (torch.load(scheduler, weights_only=True)
                           if os.path.isfile(scheduler) and self.lr_scheduler is not None else None)
        from_deepspeed = deepspeed and scheduler_state is None and self.lr_scheduler is not None and \
            _deepspeed_has_scheduler(checkpoint)
        load_checkpoint(ckpt, record.model, self._optimizers(record),
                        lr_scheduler=self.lr_scheduler if from_deepspeed else None)
        if scheduler_state is not None:
            self.lr_scheduler.load_state_dict(scheduler_state)
        self._subclass_checkpoint_chain("_load_optimizer_and_scheduler", checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if isinstance(getattr(self, "accelerator", None), ZeroAccelerator) and \
                not os.path.isdir(os.path.join(resume_from_checkpoint, ZERO_CHECKPOINT_DIR)) and \
                _is_deepspeed_run(resume_from_checkpoint):
            return  # the fp32 weights come with the optimizer's state: See [Note: a DeepSpeed run's checkpoint-N]
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _subclass_checkpoint_chain(self, name: str, path: str) -> None:
        """The trainer class's own ``name`` after the ZeRO part; See [Note: the subclass's checkpoint overrides]."""
        if isinstance(self, _StockCheckpointFloor):
            getattr(super(), name)(path)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Consolidated fp32 weights (a PEFT model: its adapter) via ``save_pretrained`` on the main
        process; every rank must call it."""
        if self._zero_record() is None:
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self._streams_save():
            # See [Note: streamed save_pretrained] in _model/hf.py: the Trainer's own files
            # (configuration, tokenizer, arguments) from the main process, then the fp32 weights unit by unit
            self._save(output_dir, state_dict={})
            self.model.save_pretrained(output_dir, is_main_process=self.args.should_save, dtype=torch.float32)
        elif self._saves_adapter():
            # See [Note: streamed adapter saves] in _model/hf.py: the units holding the adapter
            # are gathered (fp32, as full_state_dict gives), the library keeps the adapter from them
            self._save(output_dir, state_dict=api.adapter_state_dict(self.model))
        else:
            self._save(output_dir, state_dict=api.full_state_dict(self.model, rank0_only=True))
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _saves_adapter(self) -> bool:
        """Whether ``save_model`` writes an adapter only, as the stock Trainer does for a PEFT model
        (``PeftModel.save_pretrained``) or a transformers model with adapters loaded (its
        ``save_pretrained`` in PEFT's format)."""
        from transformers.trainer_utils import _is_peft_model

        return _is_peft_model(self.model) or bool(getattr(self.model, "_hf_peft_config_loaded", False))

    def _streams_save(self) -> bool:
        """Whether ``save_model`` streams: a transformers model at stage 3 (``setup`` shadowed its
        ``save_pretrained``), not an adapter model (PEFT's own save keeps the adapter only)."""
        from transformers import PreTrainedModel

        return (isinstance(self.model, PreTrainedModel) and "save_pretrained" in vars(self.model)
                and not getattr(self.model, "_hf_peft_config_loaded", False))

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
            raise FileNotFoundError(f"{type(self).__name__}: load_best_model_at_end found neither {ckpt} nor "
                                    f"safetensors weights in {best}")
        # a weights-only checkpoint (save_only_model=True): each rank reads only its slices
        load_sharded_weights(record.model, safetensors_reader(best))


def _is_deepspeed_run(checkpoint: str) -> bool:
    """Whether ``checkpoint`` (a ``checkpoint-N``) holds a DeepSpeed checkpoint (``latest`` naming a tag)."""
    return os.path.isfile(os.path.join(checkpoint, "latest")) or \
        os.path.isfile(os.path.join(checkpoint, "latest_universal"))


def _deepspeed_has_scheduler(checkpoint: str) -> bool:
    from ..checkpoint import deepspeed_lr_scheduler_state

    return deepspeed_lr_scheduler_state(checkpoint) is not None


class _StockCheckpointFloor(Trainer):
    """Right above ``Trainer`` in a ``zero_trainer`` class's MRO: the stock optimizer save / load
    does not run on a ZeRO model. See [Note: the subclass's checkpoint overrides]."""

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._zero_record() is None:
            super()._save_optimizer_and_scheduler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._zero_record() is None:
            super()._load_optimizer_and_scheduler(checkpoint)


_ZERO_CLASSES: dict[type, type] = {}


def zero_trainer(trainer_cls: type) -> type:
    """The ZeRO version of a ``transformers.Trainer`` subclass: ``Zero<Name>(ZeroTrainerMixin, trainer_cls)``
    (and a floor above ``Trainer``: See [Note: the subclass's checkpoint overrides]).

    Takes every argument ``trainer_cls`` takes, plus ``zero_config``. The same class comes
    back for the same ``trainer_cls`` (``zero_trainer(Trainer) is ZeroTrainer``), and a class
    that already has the mixin comes back unchanged.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise TypeError(f"zero_trainer: expected a transformers.Trainer subclass, got {trainer_cls!r}")
    if issubclass(trainer_cls, ZeroTrainerMixin):
        return trainer_cls
    made = _ZERO_CLASSES.get(trainer_cls)
    if made is None:
        name = f"Zero{trainer_cls.__name__}"
        bases = (ZeroTrainerMixin, trainer_cls, _StockCheckpointFloor) if trainer_cls is not Trainer else (
            ZeroTrainerMixin, _StockCheckpointFloor)
        made = type(name, bases, {
            "__module__": __name__, "__qualname__": name,
            "__doc__": f"``{trainer_cls.__qualname__}`` trained with ZeRO; see ``ZeroTrainerMixin``.\n\n"
                       + (trainer_cls.__doc__ or ""),
            **weight_push_overrides(trainer_cls)})  # OnlineDPOTrainer's vLLM push, see _vllm_sync.py
        _ZERO_CLASSES[trainer_cls] = made
    return made


def _register(trainer_cls: type, zero_cls: type) -> None:
    """Make ``zero_trainer(trainer_cls)`` return a class written out by hand (``ZeroTrainer``)."""
    _ZERO_CLASSES[trainer_cls] = zero_cls
