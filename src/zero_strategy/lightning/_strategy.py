"""``ZeroStrategy``: ZeRO for ``lightning.pytorch.Trainer``.

A :class:`~lightning.pytorch.strategies.DDPStrategy` (same launcher, cluster
environments and process-group setup: gloo on CPU, nccl on GPU) that never wraps
the module: ``setup`` hands the LightningModule and its optimizers to
``zero_strategy.setup``, which shards the module in place. Everything else is
translation of Lightning's hooks onto the engine:

* steps run through the module's ``__call__`` so the engine's root hooks fire
  (stage 3 gathers the root unit, floating inputs are cast to the compute dtype);
* ``block_backward_sync`` (gradient accumulation) is ``zero_strategy.no_sync``;
* the precision plugin is always a :class:`ZeroPrecision` (see ``_precision.py``);
* checkpoints are sharded directories (see ``_checkpoint.py``).

[Note: engine lifetime]
The engine (sharded module, fp32 masters, optimizer state) set up by ``fit`` outlives
the fit, as DDP's optimizers and DeepSpeed's engine do, so Lightning's documented
follow-ups behave as with DDP: ``trainer.save_checkpoint(path)`` (a sharded directory
with the optimizer state, resumable), ``trainer.validate / test / predict`` (they reuse
the engine, nothing is re-sharded), and another ``fit`` (it releases the engine and sets
up a new one with fresh optimizers from ``configure_optimizers``, as DDP does).
The memory is released, leaving a plain module with full weights on every rank, when

* the next ``fit`` starts, or any Trainer call with another module;
* ``trainer.strategy.teardown()`` is called outside a Trainer call (on every rank);
* a Trainer call fails (exception path);
* a validate / test / predict that set up its own engine (no fit before) ends.

Until then the module is sharded: at stage 3 ``model.state_dict()``, ``model(x)`` and
``save_pretrained`` are collectives (every rank calls them), so the rank-0-only idiom
``if trainer.is_global_zero: ...`` needs ``trainer.strategy.teardown()`` first. A
weights-only ``trainer.save_checkpoint(path, weights_only=True)`` after fit writes one
plain ``.ckpt`` file, as DDP does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .. import api as zs
from ..checkpoint import CheckpointError
from . import _checkpoint, _summary, _toggle
from ._config import build_config, warn_if_standalone_lightning, with_lightning_precision
from ._init import has_meta_tensors, meta_init_context, meta_init_enabled
from ._optimizers import is_set_up, loss_scaler_of, setup_model_and_optimizers, zero_optimizer_of
from ._precision import ZeroPrecision, check_precision_flag
from ._presets import register_into
from ._rank_zero import on_rank_zero

#: callbacks that rewrite parameters or optimizers behind the engine's back
_UNSUPPORTED_CALLBACKS = {
    "StochasticWeightAveraging": "it keeps and swaps a full copy of every parameter outside the sharded "
                                 "optimizer; average the consolidated checkpoints instead",
    "ModelPruning": "pruning re-parametrizes the module's parameters, which are views into sharded buffers",
    "BaseFinetuning": "it changes requires_grad and adds optimizer param groups during training; set up the "
                      "trainable parameters and all param groups before fit",
}


def as_zero_precision(plugin: Optional[Precision]) -> Optional[ZeroPrecision]:
    """Lightning's generic plugin for a precision flag -> ours; anything else is refused."""
    if plugin is None or isinstance(plugin, ZeroPrecision):
        return plugin
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision

    if type(plugin) in (Precision, MixedPrecision, HalfPrecision):
        return ZeroPrecision(check_precision_flag(plugin.precision))
    raise TypeError(f"ZeroStrategy cannot use the precision plugin {type(plugin).__name__}: the ZeRO engine "
                    "handles precision itself. Pass Trainer(precision='bf16-mixed' | '16-mixed' | '32-true') instead.")


def call_through_hooks(module: torch.nn.Module, method: str, *args: Any, **kwargs: Any) -> Any:
    """``module.<method>(*args)`` run as ``module(*args)`` so its forward hooks (the engine's) fire."""
    had_own_forward = "forward" in module.__dict__
    own_forward = module.__dict__.get("forward")

    def restore() -> None:
        if had_own_forward:
            module.forward = own_forward
        else:
            module.__dict__.pop("forward", None)

    def redirected(*a: Any, **k: Any) -> Any:
        restore()  # the step may call the real forward (self(x))
        return getattr(module, method)(*a, **k)

    module.forward = redirected
    try:
        return module(*args, **kwargs)
    finally:
        restore()


class ZeroStrategy(DDPStrategy):
    """ZeRO stages 1-3 with CPU offload for the Lightning Trainer.

    Takes :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`'s arguments with the same
    meaning (``ZeroStrategy(stage=3, offload_optimizer=True, offload_parameters=True)``; see
    ``_deepspeed_kwargs.py``); its default stage is 3, DeepSpeedStrategy's is 2.

    Args:
        stage, offload_optimizer, offload_params, nvme_path: override ``config``
            (``offload_optimizer=True`` / ``False`` as in DeepSpeedStrategy).
        config: a :class:`~zero_strategy.ZeroConfig`, a preset name (``"zero3_offload"``),
            a dict, or a YAML / JSON file (ours or a DeepSpeed ``ds_config``). Default: stage 3.
        meta_init: build the model inside ``configure_model`` on the meta device; the
            engine materializes it one unit at a time. ``None`` (default): under stage 3.
        param_init_fn: initializes each module of a meta-device model (default:
            ``module.reset_parameters()``).
        **kwargs: Lightning's DDPStrategy arguments (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend``, ``timeout``, ``start_method``) and any other
            :class:`~zero_strategy.ZeroConfig` field (``unit_classes``, ...), or DeepSpeedStrategy's
            (``offload_parameters``, ``offload_optimizer_device``, ``loss_scale``, ...).
            ``sequence_parallel_size=N``: Ulysses sequence parallelism over groups of N ranks; the
            data loaders are sampled over the data-parallel ranks and every batch (a dict with
            ``input_ids``) reaches ``training_step`` as this rank's shard, with ``shift_labels``:
            return ``zero_strategy.sequence_parallel_loss(shard_loss, batch["shift_labels"], self)``.
    """

    strategy_name = "zero"

    def __init__(self, stage: Optional[int] = None, offload_optimizer: Any = None, offload_params: Any = None,
                 nvme_path: Optional[str] = None, config: Any = None, *, meta_init: Optional[bool] = None,
                 param_init_fn=None, accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin: Optional[Precision] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, start_method: str = "popen",
                 **zero_fields: Any):
        with on_rank_zero():
            self._base_config = build_config(stage, offload_optimizer, offload_params, nvme_path, config,
                                             **zero_fields)
        warn_if_standalone_lightning()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.meta_init = meta_init
        self.param_init_fn = param_init_fn
        self.zero_optimizers: list = []
        self._engine = None  # the EngineView of the engine this strategy set up (see [Note: engine lifetime])
        self._engine_module = None  # the module it shards
        self._in_call = False  # between setup and teardown of one Trainer call
        self._keep_engine = False  # whether that call's teardown keeps the engine
        self._param_dtypes: dict = {}  # parameter dtypes before setup, restored at release under *-mixed
        self._error: Optional[BaseException] = None  # what interrupted fit/validate, if anything

    # ------------------------------------------------------------- precision
    @property
    def precision_plugin(self) -> ZeroPrecision:
        return self._precision_plugin if self._precision_plugin is not None else ZeroPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = as_zero_precision(plugin)

    @property
    def zero_config(self):
        """The config the engine gets: the strategy's, with the Trainer's precision applied."""
        plugin = self._precision_plugin  # None until the Trainer connects its precision: the strategy's own config
        return with_lightning_precision(self._base_config, plugin.precision if plugin is not None else None)

    # ----------------------------------------------------------------- setup
    def setup(self, trainer) -> None:
        """Shard the module for this Trainer call, or keep using the engine an earlier ``fit`` left.

        See [Note: engine lifetime]. ``fit`` always starts a new engine (Lightning calls
        ``configure_optimizers`` again, as it does for DDP); validate / test / predict reuse a
        live engine and its optimizer state, so a ``save_checkpoint`` after them still saves it.
        """
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        _refuse_unsupported_callbacks(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        reuse = is_set_up(module) and not fitting and zs.engine_of(module) is self._engine
        previous = self._engine_module if self._engine is not None else None
        if previous is not None and previous is not module and is_set_up(previous):
            self._release(previous)  # the Trainer moved on to another module: it is done with this one
        if is_set_up(module) and not reuse:  # the previous fit's engine (or one interrupted before teardown)
            self._release(module)
        self._in_call = True
        self._keep_engine = fitting or reuse
        if not reuse:
            with on_rank_zero():
                self._setup_engine(trainer, module, fitting)
        self.model = module
        self.setup_precision_plugin()
        _summary.install(trainer)

    def _setup_engine(self, trainer, module, fitting: bool) -> None:
        if not has_meta_tensors(module):  # a meta model is materialized on the device by the engine
            self.model_to_device()
        user_optimizers = []
        if fitting:
            self.setup_optimizers(trainer)
            user_optimizers = list(self.optimizers)
        config = self.zero_config
        self._param_dtypes = {name: p.dtype for name, p in module.named_parameters()}
        self.zero_optimizers = setup_model_and_optimizers(module, user_optimizers, config, device=self.root_device,
                                                          param_init_fn=self.param_init_fn)
        self._engine, self._engine_module = zs.engine_of(module), module
        self.precision_plugin.zero_optimizer = loss_scaler_of(self.zero_optimizers, config.precision)
        if fitting:
            self.optimizers = self.zero_optimizers
            _toggle.install(module)

    def _setup_model(self, model):
        return model  # never wrapped: the engine shards in place

    # ------------------------------------------------------- sequence parallelism
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's DistributedSampler over the data-parallel ranks: with
        ``sequence_parallel_size=N`` the N ranks of an SP group read the same samples (See
        [Note: sequence parallelism] in _model/sequence_parallel.py)."""
        n = self._base_config.sequence_parallel_size
        return {"num_replicas": (self.num_nodes * self.num_processes) // n, "rank": self.global_rank // n}

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        """Lightning's transfer, then, under sequence parallelism, this rank's shard of each whole-sample
        batch (``zero_strategy.shard_sequence``: ``shift_labels`` and global ``position_ids``)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self._base_config.sequence_parallel_size == 1:
            return batch
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ValueError("ZeroStrategy(sequence_parallel_size=...) shards each batch along the sequence and "
                             "needs a dict batch with input_ids [batch, seq] (labels, position_ids optional); got "
                             f"{type(batch).__name__}. Return a dict from your collate_fn")
        return zs.shard_sequence(batch, self.lightning_module)

    @contextlib.contextmanager
    def model_sharded_context(self):
        with meta_init_context(meta_init_enabled(self.meta_init, self._base_config.stage)):
            yield

    def on_exception(self, exception: BaseException) -> None:
        """Remember the error: the teardown that follows must not gather (See [Note: no collective
        on the error path] in api.py); the healthy ranks are waiting in another collective."""
        self._error = exception
        super().on_exception(exception)

    def teardown(self) -> None:
        """End of a Trainer call: keep the engine after a ``fit`` that finished; otherwise release it.

        See [Note: engine lifetime]. A call outside a Trainer call (the user's own
        ``trainer.strategy.teardown()``, on every rank) always releases.
        """
        module = self.lightning_module
        error, self._error = self._error, None
        trainer = getattr(module, "_trainer", None) if module is not None else None
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        keep = (self._in_call and self._keep_engine and error is None and not interrupted
                and module is not None and is_set_up(module))
        self._in_call = False
        save_error = None
        if error is None:
            try:  # the end of fit (or any call) waits for an asynchronous save; its failure is raised last
                _checkpoint.wait(module)
            except CheckpointError as err:
                save_error = err
        if keep:
            self._teardown_lightning_only()
        else:
            if module is not None and is_set_up(module) and (error is not None or interrupted):
                # See [Note: no collective on the error path] in api.py: release without gathering
                zs.teardown(module, error=error)
            if module is not None:
                self._release(module)
            super().teardown()
        if save_error is not None:
            raise save_error

    def _release(self, module) -> None:
        """Remove the engine: a plain module with full weights again, sharded memory freed (every rank).

        Under a ``*-mixed`` precision the weights come back in the dtype they had before setup
        (fp32, from the masters), as a DDP module's do (autocast never changes them); frozen
        parameters, which have no master, are cast back from the compute dtype. ``*-true``
        leaves them in the compute dtype, as Lightning does.
        """
        if is_set_up(module) and str(self.precision_plugin.precision).endswith("-mixed"):
            full = zs.full_state_dict(module, dtype=None)  # fp32 masters, buffers as they are
            zs.teardown(module, keep_weights=False)
            with torch.no_grad():
                for name, p in module.named_parameters(remove_duplicate=True):
                    if name in full:
                        p.data = full[name].to(self._param_dtypes.get(name, full[name].dtype))
        elif is_set_up(module):
            zs.teardown(module)
        _toggle.uninstall(module)
        self._engine = self._engine_module = None
        self.zero_optimizers = []
        if self.optimizers and any(zero_optimizer_of(o) is not None for o in self.optimizers):
            self.optimizers = []
        if self._precision_plugin is not None:
            self._precision_plugin.zero_optimizer = None

    def _teardown_lightning_only(self) -> None:
        """Lightning's end-of-call cleanup, without moving the sharded model and optimizers to the CPU
        (``Strategy.teardown`` does, which would strand the engine's buffers on another device)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ----------------------------------------------------------------- steps
    def training_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.train_step_context():
            return call_through_hooks(self.lightning_module, "training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.val_step_context():
            return call_through_hooks(self.lightning_module, "validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.test_step_context():
            return call_through_hooks(self.lightning_module, "test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any):
        with self.precision_plugin.predict_step_context():
            return call_through_hooks(self.lightning_module, "predict_step", *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Gradient accumulation: no reduction on non-boundary micro-batches (stages 2-3; stage 1 reduces at the step)."""
        module = self.lightning_module
        if module is not None and is_set_up(module):
            with zs.no_sync(module):
                yield
        else:
            yield

    def pre_backward(self, closure_loss) -> None:
        return None

    def post_backward(self, closure_loss) -> None:
        return None

    # ----------------------------------------------------------- checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded checkpoints load into the set-up engine

    def lightning_module_state_dict(self) -> dict:
        if is_set_up(self.lightning_module):
            return {}  # the weights go into the sharded files
        return super().lightning_module_state_dict()  # released: a plain module with full weights

    def optimizer_state(self, optimizer) -> dict:
        return {}  # sharded files as well

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        """Every rank writes its shards of a checkpoint directory at ``filepath``."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint does not take storage_options")
        module = self.lightning_module
        if module is not None and not is_set_up(module):  # released: a plain module, no optimizer state
            if "optimizer_states" in checkpoint:
                raise RuntimeError(
                    "ZeroStrategy: the sharded optimizer state was released (trainer.strategy.teardown() or a "
                    "failed fit); save full checkpoints before releasing, or save the weights only: "
                    "trainer.save_checkpoint(path, weights_only=True) writes a plain .ckpt file")
            return super().save_checkpoint(checkpoint, filepath)
        if not self._in_call and "optimizer_states" not in checkpoint:
            # after fit, weights only: one plain .ckpt file, as DDP writes it (load_from_checkpoint reads it)
            checkpoint = {**checkpoint, "state_dict": zs.full_state_dict(module, rank0_only=True, dtype=None)}
            return super().save_checkpoint(checkpoint, filepath)
        # every rank writes into rank 0's directory: one path for all, as FSDPStrategy does. Lightning
        # names an auto-requeue checkpoint on each rank by scanning the folder, and a rank that scans
        # while rank 0's save has begun can pick another name (See [Note: names nobody reads a number
        # from] in checkpoint/_owned.py)
        filepath = self.broadcast(filepath)
        _checkpoint.save(filepath, module, self.zero_optimizers, checkpoint)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            _checkpoint.remove(filepath, self.lightning_module)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        if Path(checkpoint_path).is_file():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # a plain .ckpt file
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        fitting = trainer is None or trainer.state.fn == TrainerFn.FITTING
        # validate/test/predict(ckpt_path=...) restore the weights only, as with DDP: the optimizer
        # state a previous fit left in the engine stays what it was
        with on_rank_zero():
            return _checkpoint.load(checkpoint_path, module, self.zero_optimizers if fitting else [],
                                    weights_only=weights_only, strict=module.strict_loading)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        state_dict = checkpoint.get("state_dict")
        if not state_dict:
            return  # a sharded checkpoint: loaded in load_checkpoint
        # a full state dict from a plain .ckpt (e.g. a DDP run), read by every rank: load_state_dict
        # on a set-up model writes each rank's slices into the shards and fp32 masters (_model/state_dict.py)
        self.lightning_module.load_state_dict(state_dict, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if any(checkpoint.get("optimizer_states", [])):
            raise MisconfigurationException(
                "ZeroStrategy cannot resume optimizer state from a plain Lightning checkpoint file (it is not "
                "sharded); resume from a ZeroStrategy checkpoint directory, or load only the weights "
                "(LightningModule.load_from_checkpoint) and start the optimizer fresh")

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        register_into(strategy_registry, cls, "trainer")


def _refuse_unsupported_callbacks(trainer) -> None:
    for cb in trainer.callbacks:
        for klass in type(cb).__mro__:
            if klass.__name__ in _UNSUPPORTED_CALLBACKS:
                raise MisconfigurationException(
                    f"{type(cb).__name__} cannot be used with ZeroStrategy: {_UNSUPPORTED_CALLBACKS[klass.__name__]}.")
