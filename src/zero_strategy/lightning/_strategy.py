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
* checkpoints are sharded directories (see ``_checkpoint.py``);
* teardown removes the engine's hooks and leaves a plain module with full weights.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .. import api as zs
from . import _checkpoint, _summary, _toggle
from ._config import build_config, with_lightning_precision
from ._init import has_meta_tensors, meta_init_context, meta_init_enabled
from ._optimizers import is_set_up, loss_scaler_of, setup_model_and_optimizers
from ._precision import ZeroPrecision, check_precision_flag

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

    Args:
        stage, offload_optimizer, offload_params, nvme_path: override ``config``.
        config: a :class:`~zero_strategy.ZeroConfig`, a preset name (``"zero3_offload"``),
            a dict, or a YAML / JSON file (ours or a DeepSpeed ``ds_config``). Default: stage 3.
        meta_init: build the model inside ``configure_model`` on the meta device; the
            engine materializes it one unit at a time. ``None`` (default): under stage 3.
        param_init_fn: initializes each module of a meta-device model (default:
            ``module.reset_parameters()``).
        **kwargs: Lightning's DDPStrategy arguments (``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend``, ``timeout``, ``start_method``) and any other
            :class:`~zero_strategy.ZeroConfig` field (``unit_classes``, ...).
    """

    strategy_name = "zero"

    def __init__(self, stage: Optional[int] = None, offload_optimizer: Any = None, offload_params: Any = None,
                 nvme_path: Optional[str] = None, config: Any = None, *, meta_init: Optional[bool] = None,
                 param_init_fn=None, accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision_plugin: Optional[Precision] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, start_method: str = "popen",
                 **zero_fields: Any):
        self._base_config = build_config(stage, offload_optimizer, offload_params, nvme_path, config, **zero_fields)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)
        self.meta_init = meta_init
        self.param_init_fn = param_init_fn
        self.zero_optimizers: list = []
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
        return with_lightning_precision(self._base_config, self.precision_plugin.precision)

    # ----------------------------------------------------------------- setup
    def setup(self, trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        _refuse_unsupported_callbacks(trainer)
        module = self.lightning_module
        if is_set_up(module):  # e.g. fit() interrupted before teardown
            zs.teardown(module)
        if not has_meta_tensors(module):  # a meta model is materialized on the device by the engine
            self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        user_optimizers = []
        if fitting:
            self.setup_optimizers(trainer)
            user_optimizers = list(self.optimizers)
        config = self.zero_config
        self.zero_optimizers = setup_model_and_optimizers(module, user_optimizers, config, device=self.root_device,
                                                          param_init_fn=self.param_init_fn)
        self.precision_plugin.zero_optimizer = loss_scaler_of(self.zero_optimizers, config.precision)
        if fitting:
            self.optimizers = self.zero_optimizers
            _toggle.install(module)
        self.model = module
        self.setup_precision_plugin()
        _summary.install(trainer)

    def _setup_model(self, model):
        return model  # never wrapped: the engine shards in place

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
        module = self.lightning_module
        error, self._error = self._error, None
        if module is not None and is_set_up(module):
            zs.teardown(module, error=error)
        if module is not None:
            _toggle.uninstall(module)
        self.zero_optimizers = []
        if self._precision_plugin is not None:
            self._precision_plugin.zero_optimizer = None
        super().teardown()

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
        return super().lightning_module_state_dict()  # after fit: a plain module with full weights

    def optimizer_state(self, optimizer) -> dict:
        return {}  # sharded files as well

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        """Every rank writes its shards of a checkpoint directory at ``filepath``."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint does not take storage_options")
        module = self.lightning_module
        if module is not None and not is_set_up(module):  # after fit: teardown left a plain module
            if "optimizer_states" in checkpoint:
                raise RuntimeError(
                    "ZeroStrategy: the sharded optimizer was released at the end of fit; save full checkpoints "
                    "during fit (ModelCheckpoint, or trainer.save_checkpoint in a callback), or after fit save "
                    "the weights only: trainer.save_checkpoint(path, weights_only=True) writes a plain .ckpt file")
            return super().save_checkpoint(checkpoint, filepath)
        _checkpoint.save(filepath, module, self.zero_optimizers, checkpoint)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            _checkpoint.remove(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict:
        if Path(checkpoint_path).is_file():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # a plain .ckpt file
        module = self.lightning_module
        return _checkpoint.load(checkpoint_path, module, self.zero_optimizers, weights_only=weights_only,
                                strict=module.strict_loading)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        state_dict = checkpoint.get("state_dict")
        if not state_dict:
            return  # a sharded checkpoint: loaded in load_checkpoint
        # a full state dict from a plain .ckpt (e.g. a DDP run), read by every rank: load_state_dict
        # on a set-up model writes each rank's slices into the shards and fp32 masters (_module_state.py)
        self.lightning_module.load_state_dict(state_dict, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        if any(checkpoint.get("optimizer_states", [])):
            raise MisconfigurationException(
                "ZeroStrategy cannot resume optimizer state from a plain Lightning checkpoint file (it is not "
                "sharded); resume from a ZeroStrategy checkpoint directory, or load only the weights "
                "(LightningModule.load_from_checkpoint) and start the optimizer fresh")

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        from ._registry import register_presets

        register_presets(strategy_registry, "trainer")


def _refuse_unsupported_callbacks(trainer) -> None:
    for cb in trainer.callbacks:
        for klass in type(cb).__mro__:
            if klass.__name__ in _UNSUPPORTED_CALLBACKS:
                raise MisconfigurationException(
                    f"{type(cb).__name__} cannot be used with ZeroStrategy: {_UNSUPPORTED_CALLBACKS[klass.__name__]}.")
