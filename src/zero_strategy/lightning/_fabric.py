"""``ZeroFabricStrategy``: ZeRO for ``lightning.fabric.Fabric``.

``fabric.setup(model, optimizer, ...)`` -> ``zero_strategy.setup`` (in place, no
wrapper besides Fabric's own); ``fabric.backward`` scales fp16 losses through the
ZeroOptimizer; ``fabric.clip_gradients(max_norm=...)`` clips by the global norm over
shards, ``clip_val=...`` by value; ``fabric.no_backward_sync`` is ``zero_strategy.no_sync``; ``fabric.save`` /
``fabric.load`` write and read sharded checkpoint directories (the model and its
optimizer(s) as shards, every other entry of the state as Lightning would pickle it).
"""

from __future__ import annotations

import contextlib
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Stateful

from .. import api as zs
from .._optim.optimizer import ZeroOptimizer
from ..checkpoint import load_metadata, save_checkpoint, wait_for_save
from ..checkpoint._load import prepare_load
from . import _checkpoint
from ._config import build_config, warn_if_standalone_lightning, with_lightning_precision
from ._init import has_meta_tensors, meta_init_context, meta_init_enabled
from ._optimizers import is_set_up, loss_scaler_of, setup_model_and_optimizers, zero_optimizer_of
from ._precision import ZeroFabricPrecision, check_precision_flag
from ._presets import register_into
from ._rank_zero import on_rank_zero

_KEYS = "__zero_strategy_fabric__"


def as_zero_fabric_precision(plugin: Optional[Precision]) -> Optional[ZeroFabricPrecision]:
    if plugin is None or isinstance(plugin, ZeroFabricPrecision):
        return plugin
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision

    if type(plugin) in (Precision, MixedPrecision, HalfPrecision):
        return ZeroFabricPrecision(check_precision_flag(plugin.precision))
    raise TypeError(f"ZeroFabricStrategy cannot use the precision plugin {type(plugin).__name__}: the ZeRO engine "
                    "handles precision itself. Pass Fabric(precision='bf16-mixed' | '16-mixed' | '32-true').")


class _ZeroBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        return zs.no_sync(module) if enabled else contextlib.nullcontext()


class ZeroFabricStrategy(DDPStrategy):
    """ZeRO stages 1-3 with CPU offload for Fabric; same arguments as :class:`ZeroStrategy`."""

    def __init__(self, stage: Optional[int] = None, offload_optimizer: Any = None, offload_params: Any = None,
                 nvme_path: Optional[str] = None, config: Any = None, *, meta_init: Optional[bool] = None,
                 param_init_fn=None, accelerator=None, parallel_devices=None, cluster_environment=None, checkpoint_io=None,
                 precision: Optional[Precision] = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, start_method: str = "popen",
                 **zero_fields: Any):
        with on_rank_zero():
            self._base_config = build_config(stage, offload_optimizer, offload_params, nvme_path, config,
                                             **zero_fields)
        warn_if_standalone_lightning()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self._backward_sync_control = _ZeroBackwardSyncControl()
        self.meta_init = meta_init
        self.param_init_fn = param_init_fn
        self.zero_optimizers: list[ZeroOptimizer] = []
        self._saved_module: Optional[weakref.ref] = None  # the module of the last save, waited for at teardown

    @property
    def precision(self) -> ZeroFabricPrecision:
        return self._precision if self._precision is not None else ZeroFabricPrecision()

    @precision.setter
    def precision(self, plugin: Optional[Precision]) -> None:
        self._precision = as_zero_fabric_precision(plugin)

    @property
    def zero_config(self):
        plugin = self._precision  # None until Fabric connects its precision: the strategy's own config
        return with_lightning_precision(self._base_config, plugin.precision if plugin is not None else None)

    # ----------------------------------------------------------------- setup
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """``fabric.setup_dataloaders``' sampler over the data-parallel ranks: with
        ``sequence_parallel_size=N`` the N ranks of an SP group read the same samples; shard each
        batch with ``zero_strategy.shard_sequence(batch, model)``."""
        n = self._base_config.sequence_parallel_size
        return {"num_replicas": (self.num_nodes * self.num_processes) // n, "rank": self.global_rank // n}

    def setup_module_and_optimizers(self, module, optimizers, scheduler=None):
        self.module_to_device(module)
        config = self.zero_config
        with on_rank_zero():
            self.zero_optimizers = setup_model_and_optimizers(module, list(optimizers), config,
                                                              device=self.root_device, param_init_fn=self.param_init_fn)
        self.precision.zero_optimizer = loss_scaler_of(self.zero_optimizers, config.precision)
        return module, list(self.zero_optimizers), scheduler

    def setup_module(self, module):
        self.module_to_device(module)
        with on_rank_zero():
            setup_model_and_optimizers(module, [], self.zero_config, device=self.root_device,
                                       param_init_fn=self.param_init_fn)
        return module

    def module_to_device(self, module) -> None:
        if not has_meta_tensors(module):  # a meta model is materialized on the device by the engine
            module.to(self.root_device)

    def setup_optimizer(self, optimizer):
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def module_init_context(self, empty_init: Optional[bool] = None):
        stack = contextlib.ExitStack()
        stack.enter_context(super().module_init_context(empty_init=empty_init))
        stack.enter_context(meta_init_context(self._meta_init_enabled(empty_init)))
        return stack

    def _meta_init_enabled(self, empty_init: Optional[bool]) -> bool:
        if empty_init is False:
            return False  # fabric.init_module(empty_init=False): the caller wants initialized weights now
        return meta_init_enabled(self.meta_init, self._base_config.stage)

    def teardown(self) -> None:
        saved = self._saved_module() if self._saved_module is not None else None
        self._saved_module = None
        if saved is not None and is_set_up(saved):
            wait_for_save(saved)  # an asynchronous fabric.save still writing (async_save in the config)
        self.zero_optimizers = []
        if self._precision is not None:
            self._precision.zero_optimizer = None
        super().teardown()

    # -------------------------------------------------------------- clipping
    def clip_gradients_norm(self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite=True):
        zopt = zero_optimizer_of(optimizer)
        if zopt is None:
            raise TypeError("clip_gradients: pass the optimizer returned by fabric.setup")
        norm = zopt.clip_grad_norm_(max_norm, norm_type)
        # fp16: an overflow gives an infinite norm and skips the step on every rank; that is not an error
        if error_if_nonfinite and not zopt.scaler.enabled and not torch.isfinite(norm):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients is non-finite, so it "
                               "cannot be clipped. Pass error_if_nonfinite=False to ignore this.")
        return norm

    def clip_gradients_value(self, module, optimizer, clip_val) -> None:
        """``fabric.clip_gradients(model, optimizer, clip_val=...)``: elementwise on the unscaled shards."""
        zopt = zero_optimizer_of(optimizer)
        if zopt is None:
            raise TypeError("clip_gradients: pass the optimizer returned by fabric.setup")
        zopt.clip_grad_value_(clip_val)

    # ----------------------------------------------------------- checkpoints
    def save_checkpoint(self, path, state: dict, storage_options: Any = None, filter: Optional[dict] = None) -> None:
        if storage_options is not None or filter:
            raise TypeError("ZeroFabricStrategy.save_checkpoint takes no storage_options or filter")
        module, module_key, optimizer_keys, rest = _split_state(state)
        zopts = list(self.zero_optimizers) if optimizer_keys else None
        rest[_KEYS] = {"module": module_key, "optimizers": optimizer_keys}
        save_checkpoint(path, module, zopts, extra_state=_checkpoint.pack(rest))
        self._saved_module = weakref.ref(module)  # teardown waits for its save (async_save)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None):
        if Path(path).is_file():
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if isinstance(state, torch.nn.Module):
            state = {"model": state}
        if not state:
            raise ValueError("ZeroFabricStrategy loads sharded checkpoints in place: pass the state to restore, "
                             "e.g. fabric.load(path, {'model': model, 'optimizer': optimizer})")
        module, module_key, optimizer_keys, _ = _split_state(state)
        if _checkpoint.is_deepspeed(path):  # See [Note: a DeepSpeedStrategy checkpoint in Fabric]
            read_saved = _deepspeed_client_state
        else:
            meta = load_metadata(path)
            has_optimizer = bool(meta.get("optimizer") or meta.get("optimizers"))
            if optimizer_keys and not has_optimizer:
                raise KeyError(f"{path} was saved without optimizer state; leave the optimizer out of the state")

            def read_saved(extra):
                saved = _checkpoint.unpack(extra, weights_only)
                saved.pop(_KEYS, None)
                return saved

        def accept(extra):  # before anything is copied: a refusal here changes nothing
            saved = read_saved(extra)
            missing = [k for k in state if k != module_key and k not in optimizer_keys and k not in saved]
            if strict and missing:
                raise KeyError(f"The requested state contains a key {missing[0]!r} that does not exist in the "
                               "loaded checkpoint. To disable strict loading, set `strict=False`.")
            return saved

        with on_rank_zero(), prepare_load(path, module, list(self.zero_optimizers) if optimizer_keys else None,
                                          strict=strict, accept_extra=accept) as load:
            saved = load.commit()
        for name, obj in list(state.items()):
            if name == module_key or name in optimizer_keys or name not in saved:
                continue
            if isinstance(obj, _Stateful):
                obj.load_state_dict(saved.pop(name))
            else:
                state[name] = saved.pop(name)
        return saved

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        register_into(strategy_registry, cls, "fabric")


# [Note: a DeepSpeedStrategy checkpoint in Fabric]
# Fabric's DeepSpeedStrategy.save_checkpoint(path, state) gives the engine and its optimizer to
# DeepSpeed's ``engine.save_checkpoint(path, client_state=<the rest of state, stateful objects as their
# state_dict()>, tag="checkpoint")``. ``fabric.load(path, state)`` reads such a directory as its own
# DeepSpeedStrategy.load_checkpoint would: the weights and optimizer state through the DeepSpeed reader
# of checkpoint/ (See [Note: DeepSpeed's layout] in checkpoint/_deepspeed.py), at any world size and
# stage; every other key of ``state`` from the client_state (a stateful object through its
# load_state_dict), the rest of the client_state returned. Unlike Fabric's DeepSpeedStrategy, a key of
# ``state`` the client_state lacks is refused under ``strict``, as for our own checkpoints, and before
# anything is copied (DeepSpeed's reader checks the files first too: See [Note: verify, agree, then
# copy] in checkpoint/_load.py).
def _deepspeed_client_state(client_state: Any) -> dict[str, Any]:
    if not isinstance(client_state, dict):
        raise ValueError(f"this DeepSpeed checkpoint's client_state is a {type(client_state).__name__}, not the "
                         "dict Fabric's DeepSpeedStrategy saves; load it with zero_strategy.load_checkpoint")
    return dict(client_state)


def _split_state(state: dict) -> tuple[torch.nn.Module, str, list[str], dict]:
    """(the one set-up module, its key, keys of its optimizers, everything else as saved values)."""
    from lightning.fabric.wrappers import _unwrap_objects

    state = _unwrap_objects(state)
    modules = [k for k, v in state.items() if isinstance(v, torch.nn.Module)]
    set_up = [k for k in modules if is_set_up(state[k])]
    if len(set_up) != 1 or len(modules) != 1:
        raise ValueError("a ZeroFabricStrategy checkpoint holds exactly one model set up with fabric.setup; "
                         f"found modules {modules}. Save other models in separate checkpoints.")
    optimizer_keys = [k for k, v in state.items() if isinstance(v, ZeroOptimizer)]
    rest = {}
    for k, v in state.items():
        if k in set_up or k in optimizer_keys:
            continue
        if isinstance(v, torch.optim.Optimizer):
            raise ValueError(f"state[{k!r}] is an optimizer that fabric.setup did not set up with the model")
        rest[k] = v.state_dict() if isinstance(v, _Stateful) else v
    return state[set_up[0]], set_up[0], optimizer_keys, rest
