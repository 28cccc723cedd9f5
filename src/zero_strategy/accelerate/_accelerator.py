"""``ZeroAccelerator``: ``accelerate.Accelerator`` with ZeRO sharding in place of DDP.

[Note: what changes and what does not]
Everything Accelerate does for data loaders, schedulers, gradient accumulation
bookkeeping, logging, trackers, RNG and process control is untouched. What DDP
would do to the model and optimizer is replaced, and only that:

* ``prepare`` pairs each optimizer with the model it trains and calls
  ``zero_strategy.setup(model, optimizer, config)``: the model is sharded **in
  place** (no wrapper; ``unwrap_model`` returns the same object) and the optimizer
  comes back as a :class:`ZeroAcceleratedOptimizer` over the ZeroOptimizer. A model
  prepared before its optimizer waits (unsharded) for it, because ``setup`` needs
  both at once; a model with no trainable parameters stays replicated. See
  [Note: a model whose optimizer was never prepared].
* Accelerate's autocast and GradScaler are off: ``mixed_precision`` becomes the
  engine's precision (bf16/fp16 parameters, fp32 masters, ZeRO's own fp16 scaler).
* ``backward`` divides by the accumulation steps as Accelerate does and applies
  the fp16 loss scale; ``no_sync`` / ``accumulate`` use ``zero_strategy.no_sync``;
  ``clip_grad_norm_`` is the global norm over all shards; ``clip_grad_value_`` clamps
  the reduced gradient shards (elementwise, so the same as on the full gradients).
* ``get_state_dict`` consolidates on rank 0; ``save_model`` writes stock Accelerate's files,
  at stage 3 unit by unit (see ``_saving.py``); ``save_state`` /
  ``load_state`` save every rank's shard (see ``_checkpointing.py``).
* ``free_memory`` / ``end_training`` tear the engines down (hooks removed, full
  weights back in the modules); every process must call them.

[Note: a model whose optimizer was never prepared]
Stock Accelerate wraps a model prepared alone in DDP, so an optimizer the script
built but never passed to ``prepare`` still sees gradients averaged across
processes. Here such a model waits, unsharded and unwrapped, for its optimizer;
trained as it is, each process would step on its own gradients and the replicas
would drift apart without a word (measured: 1.14 apart after a few steps). Falling
back to DDP would train correctly but without the sharding the user switched to
ZeroAccelerator for, and no optimizer state can be sharded without the optimizer.
So the first backward that reaches such a model's parameters raises, naming the
fix (pass the optimizer to ``prepare``), on every process, before any step; a
pending model used only for forward passes (evaluation, generation) is fine. The
guard is a post-accumulate-grad hook per trainable parameter, removed when the
model is sharded or the accelerator is torn down.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DynamoBackend
from accelerate.utils.other import compile_regions_deepspeed, is_compiled_module
from torch import nn

from .. import api
from .._engine.plan import plan_for
from ..config import ZeroConfig
from . import _checkpointing, _saving
from ._config import apply_precision, choose_spec, deepspeed_accumulation_steps, describe, load_config
from ._launch import (adopt_deepspeed_launch, check_after_init, launched_processes, logger,
                      refuse_sharding_launchers, requested_parallelism, use_cpu_if_no_device)
from ._optimizer import ZeroAcceleratedOptimizer

UNPREPARED_OPTIMIZER = (
    "ZeroAccelerator: backward reached a model that was prepared without its optimizer, so its gradients would not "
    "be synchronized across processes and the replicas would drift apart (stock Accelerate would have wrapped it "
    "in DDP; ZeroAccelerator shards a model together with its optimizer). Fix: pass the optimizer to prepare, "
    "`model, optimizer = accelerator.prepare(model, optimizer)` (or `optimizer = accelerator.prepare(optimizer)` "
    "after building it over model.parameters()), and step that prepared optimizer.")


@dataclass
class ZeroModelRecord:
    """One sharded model and the optimizers ``setup`` re-homed onto its shards."""
    model: nn.Module
    optimizers: list[ZeroAcceleratedOptimizer] = field(default_factory=list)
    #: prepared with ``prepare_frozen_model``: kept across ``free_memory`` (see there)
    frozen: bool = False


class ZeroAccelerator(Accelerator):
    """A drop-in ``accelerate.Accelerator`` that shards models with ZeRO instead of wrapping them in DDP.

    Args:
        zero_config: preset name (``"zero3"``), path to a YAML/JSON file (ours or a
            DeepSpeed ``ds_config``), a mapping, or a :class:`~zero_strategy.ZeroConfig`.
            Default: the environment variable ``ZERO_STRATEGY_CONFIG``, else the ds_config of a
            DEEPSPEED accelerate launch, else ``"zero3"`` (see ``_config.py``).
        **accelerator_kwargs: everything ``accelerate.Accelerator`` takes
            (``mixed_precision``, ``gradient_accumulation_steps``, ``project_dir``, ...),
            except DeepSpeed/FSDP/Megatron plugins.
        param_init_fn: for a model created on the meta device, ``param_init_fn(module)``
            initializes each module as the engine materializes it (as in
            :func:`zero_strategy.setup`; e.g. a Hugging Face model's ``_init_weights``, which
            also fills rotary buffers). Also settable as ``accelerator.param_init_fn``
            before the model's optimizer is prepared.
    """

    #: Under an adopted DEEPSPEED launch (see [Note: adopting a DeepSpeed launch] in _launch.py):
    #: what an "auto" gradient_clipping becomes (Accelerate's DeepSpeed integration: 1.0), and
    #: whether the ds_config's numeric gradient_accumulation_steps wins over the Accelerator's
    #: (Accelerate: yes, with a warning) or must equal it (the HF Trainer's integration).
    deepspeed_auto_gradient_clipping: float | None = 1.0
    deepspeed_accumulation_wins: bool = True
    #: every generate() of the models this accelerator sets up gathers each unit once (stage 3;
    #: ``zero_strategy.gather_once_in_generate``); the Trainer front end turns it on
    gather_once_in_generate: bool = False

    def __init__(self, zero_config=None, *, param_init_fn=None, **accelerator_kwargs):
        adopt_deepspeed_launch()  # see [Note: adopting a DeepSpeed launch] in _launch.py
        refuse_sharding_launchers(accelerator_kwargs)
        spec, source = choose_spec(zero_config, self.deepspeed_auto_gradient_clipping)
        parsed = load_config(spec, source)  # unknown presets/keys fail before the process group starts
        accelerator_kwargs["cpu"] = use_cpu_if_no_device(bool(accelerator_kwargs.get("cpu", False)))
        parallelism = requested_parallelism(accelerator_kwargs.get("parallelism_config"))
        parsed = _with_sequence_parallel(parsed, parallelism)  # See [Note: sequence parallelism under Accelerate]
        if parsed.sequence_parallel_size > 1:
            _refuse_sequence_parallel_size(parsed.sequence_parallel_size, launched_processes())
            accelerator_kwargs.pop("parallelism_config", None)
            with _launch_parallelism_off():
                super().__init__(**accelerator_kwargs)
        else:
            super().__init__(**accelerator_kwargs)
        check_after_init(self)
        #: this rank's SP group (size 1: none); See [Note: sequence parallelism under Accelerate]
        self.sequence_parallel = self._sequence_parallel_mesh(parsed.sequence_parallel_size, parallelism)
        mixed_precision = str(self.mixed_precision)
        self._zero_config = apply_precision(parsed, mixed_precision, source)
        steps = deepspeed_accumulation_steps(spec, source)
        if steps is not None and steps != self.gradient_accumulation_steps and not self.deepspeed_accumulation_wins:
            raise ValueError(
                f"ZeroAccelerator: the DeepSpeed config's gradient_accumulation_steps ({steps}) differs from the "
                f"trainer's ({self.gradient_accumulation_steps}); set them equal, or write \"auto\" in the DeepSpeed "
                "config (as the Hugging Face Trainer's DeepSpeed integration requires)")
        if steps is not None and steps != self.gradient_accumulation_steps:
            logger.warning("ZeroAccelerator: gradient accumulation steps mismatch: the Accelerator has %d, the "
                           "DeepSpeed config has %d. Using DeepSpeed's value (as Accelerate does).",
                           self.gradient_accumulation_steps, steps)
            self.gradient_accumulation_steps = steps
        # [Note: what changes] the engine owns precision: no autocast wrapper, no GradScaler
        self.native_amp = False
        self.scaler = None
        self._zero_records: list[ZeroModelRecord] = []
        self._pending: list[nn.Module] = []
        self._pending_guards: dict[int, list] = {}
        self.param_init_fn = param_init_fn
        logger.info("ZeroAccelerator: %s from %s on %d process(es)", describe(self._zero_config), source,
                    self.num_processes)

    # ------------------------------------------------------------------ queries
    @property
    def zero_config(self) -> ZeroConfig:
        """The resolved config every model prepared here is sharded with."""
        return self._zero_config

    @property
    def zero_models(self) -> list[ZeroModelRecord]:
        return list(self._zero_records)

    @property
    def pending_models(self) -> list[nn.Module]:
        """Models prepared for training whose optimizer has not been prepared yet (not sharded yet)."""
        return list(self._pending)

    def is_zero_model(self, model) -> bool:
        return self._record_of(model) is not None

    def _record_of(self, model) -> ZeroModelRecord | None:
        return next((r for r in self._zero_records if r.model is model), None)

    def _zero_optimizers(self):
        return [o.zero_optimizer for r in self._zero_records for o in r.optimizers]

    def _sequence_parallel_mesh(self, size: int, parallelism) -> api.SequenceParallelGroup:
        """The SP group, and the ("dp", "sp") mesh and ParallelismConfig Accelerate's users read."""
        if size == 1:
            return api.SequenceParallelGroup(None, 0, 1)
        from accelerate.parallelism_config import ParallelismConfig
        from torch.distributed.device_mesh import DeviceMesh

        _refuse_sequence_parallel_size(size, self.num_processes)
        dp = (getattr(parallelism, "dp_replicate_size", 1) or 1) * (getattr(parallelism, "dp_shard_size", 1) or 1)
        if dp not in (1, self.num_processes // size):
            raise ValueError(f"ZeroAccelerator: ParallelismConfig asks for {dp} data-parallel ranks (dp_replicate_size x "
                             f"dp_shard_size) beside sp_size={size}, but {self.num_processes} processes leave "
                             f"{self.num_processes // size}; drop the dp sizes (ZeRO shards over every rank) or set "
                             f"them to {self.num_processes // size}")
        sp, dp_group = api.sequence_parallel_groups(size)
        mesh = torch.arange(self.num_processes).view(self.num_processes // size, size)
        self.state.device_mesh = DeviceMesh.from_group([dp_group, sp.group], self.device.type, mesh=mesh,
                                                       mesh_dim_names=("dp", "sp"))
        if parallelism is None:
            parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=size)
        self.state.parallelism_config = parallelism
        return sp

    # ------------------------------------------------------------------ prepare
    def prepare(self, *args, device_placement=None):
        """Like ``Accelerator.prepare``; models and their optimizers are ZeRO-sharded instead of DDP-wrapped."""
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(f"`device_placement` should be a list with {len(args)} elements (the number of "
                             "objects passed).")
        result = list(args)
        new_models: list[nn.Module] = []
        optimizers: list[tuple[int, torch.optim.Optimizer]] = []
        for i, (obj, place) in enumerate(zip(args, device_placement)):
            if isinstance(obj, nn.Module):
                result[i] = self._take_model(obj, place)
                if obj not in new_models and obj not in self._pending:
                    new_models.append(obj)
            elif isinstance(obj, AcceleratedOptimizer):
                result[i] = self._already_prepared_optimizer(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                optimizers.append((i, obj))
            elif isinstance(obj, torch.utils.data.DataLoader):
                result[i] = self.prepare_data_loader(obj, device_placement=place)
        for i, wrapped in self._shard(new_models, optimizers).items():
            result[i] = wrapped
        for m in new_models:  # prepared for training without an optimizer (yet)
            if self._record_of(m) is None and any(p.requires_grad for p in m.parameters()):
                self._pending.append(m)
                self._guard_pending(m)
        for i, obj in enumerate(args):  # schedulers last: they need the prepared optimizers
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                result[i] = self.prepare_scheduler(obj)
        return tuple(result) if len(result) > 1 else result[0]

    def _take_model(self, model: nn.Module, place) -> nn.Module:
        if self.is_zero_model(model):
            raise ValueError(
                "ZeroAccelerator.prepare: this model is already prepared (sharded); prepare each model once. To "
                "train it again from scratch with a new optimizer call accelerator.free_memory() first.")
        if model in self._pending or model in self._models:
            return model
        if place is None:
            place = self.device_placement
        if place and not _has_meta_tensors(model):  # a meta model is materialized by the engine at setup
            model = model.to(self.device)
        self._models.append(model)
        model._is_accelerate_prepared = True
        self._compile_in_place(model)
        return model

    def _guard_pending(self, model: nn.Module) -> None:
        """See [Note: a model whose optimizer was never prepared]."""
        def refuse(_param):
            raise RuntimeError(UNPREPARED_OPTIMIZER)

        self._pending_guards[id(model)] = [p.register_post_accumulate_grad_hook(refuse)
                                           for p in model.parameters() if p.requires_grad]

    def _unguard(self, model: nn.Module) -> None:
        for handle in self._pending_guards.pop(id(model), []):
            handle.remove()

    def _adopt_auto_choice(self, model: nn.Module) -> None:
        """``zero_auto``: the preset setup chose for the first model becomes this accelerator's
        config (``zero_config``, checkpoint metadata, later models), so one run has one layout."""
        if self._zero_config.auto:
            self._zero_config = api.engine_of(model).config
            if self.is_main_process:
                logger.info("ZeroAccelerator: zero_auto chose %s", describe(self._zero_config))

    def _compile_in_place(self, model: nn.Module) -> None:
        """``dynamo_backend`` / ``--dynamo_backend``: compile the model *in place*.

        Accelerate's DDP path returns ``torch.compile(model)``, a wrapper whose state-dict
        names gain ``_orig_mod.``; a sharded model must keep the object and the names it is
        set up with (checkpoints, ``unwrap_model``), so here ``model.compile()`` is used, or,
        with ``use_regional_compilation``, ``block.compile()`` on each repeated block
        (Accelerate's own in-place variant for DeepSpeed). Compilation is lazy: tracing
        starts at the first forward, after setup, with the engine's hooks run eagerly
        around the compiled code (See [Note: torch.compile and the hooks] in _engine/engine.py).
        """
        plugin = self.state.dynamo_plugin
        if plugin.backend == DynamoBackend.NO or is_compiled_module(model):
            return
        if plugin.use_regional_compilation:
            compile_regions_deepspeed(model, **plugin.to_kwargs())
        else:
            model.compile(**plugin.to_kwargs())

    def _already_prepared_optimizer(self, optimizer: AcceleratedOptimizer) -> AcceleratedOptimizer:
        if isinstance(optimizer, ZeroAcceleratedOptimizer):  # the records say which optimizers are alive here
            if not any(optimizer in r.optimizers for r in self._zero_records):
                raise ValueError(
                    "ZeroAccelerator.prepare: this optimizer was prepared for a model that has since been torn down "
                    "(free_memory) or prepared by another accelerator; create a new optimizer over the model's "
                    "parameters and prepare both together")
        if optimizer not in self._optimizers:
            self._optimizers.append(optimizer)
        return optimizer

    def _shard(self, new_models, optimizers) -> dict[int, ZeroAcceleratedOptimizer]:
        """``zero_strategy.setup`` for each model that has optimizers; returns the wrapped ones by position."""
        if not optimizers:
            return {}
        candidates = list(new_models) + [m for m in self._pending if m not in new_models]
        owned: dict[int, list[tuple[int, torch.optim.Optimizer, frozenset[int]]]] = {}
        for i, opt in optimizers:
            ids = frozenset(id(p) for g in opt.param_groups for p in g["params"])
            owner = next((m for m in candidates if ids <= {id(p) for p in m.parameters()}), None)
            if owner is None:
                raise ValueError(
                    "ZeroAccelerator.prepare: an optimizer's parameters do not all belong to one model prepared "
                    "by this accelerator; pass the model in the same prepare() call as its optimizer (or in an "
                    "earlier one), and build the optimizer from that model's parameters")
            owned.setdefault(id(owner), []).append((i, opt, ids))
        out: dict[int, ZeroAcceleratedOptimizer] = {}
        for model in candidates:
            entries = owned.get(id(model))
            if not entries:
                continue
            if len(entries) > 1 and self._zero_config.precision == "fp16":
                raise NotImplementedError(
                    "ZeroAccelerator: fp16 with several optimizers on one model is not supported (one loss scale per "
                    "optimizer, but accelerator.backward cannot tell which loss belongs to which); use bf16")
            raw = [opt for _, opt, _ in entries]
            self._check_attention(model)
            self._unguard(model)
            _, zopts = api.setup(model, raw if len(raw) > 1 else raw[0], self._zero_config,
                                 param_init_fn=self.param_init_fn)
            self._adopt_auto_choice(model)
            api.gather_once_in_generate(model, self.gather_once_in_generate)
            zopts = zopts if isinstance(zopts, list) else [zopts]
            record = ZeroModelRecord(model)
            for (i, _, ids), zopt in zip(entries, zopts):
                wrapped = ZeroAcceleratedOptimizer(zopt, ids)
                wrapped._is_accelerate_prepared = True
                record.optimizers.append(wrapped)
                self._optimizers.append(wrapped)
                out[i] = wrapped
            self._zero_records.append(record)
            if model in self._pending:
                self._pending.remove(model)
        if self._zero_config.precision == "fp16" and len(self._zero_optimizers()) > 1:
            raise NotImplementedError(
                "ZeroAccelerator: fp16 with several ZeRO optimizers is not supported (accelerator.backward cannot "
                "tell which loss scale applies); use bf16")
        return out

    def _check_attention(self, model: nn.Module) -> None:
        """``sp_attn_implementation`` must be the model's own: the one that is wrapped (DeepSpeed refuses
        a mismatch the same way)."""
        handler = getattr(self.state.parallelism_config, "sp_handler", None) if self.sequence_parallel.size > 1 else None
        wanted = getattr(handler, "sp_attn_implementation", None)
        have = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if wanted is not None and have is not None and wanted != have:
            raise ValueError(f"ZeroAccelerator: DeepSpeedSequenceParallelConfig(sp_attn_implementation={wanted!r}) "
                             f"differs from the model's attn_implementation {have!r}; load the model with "
                             f"attn_implementation={wanted!r}, or set sp_attn_implementation={have!r}")

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Accelerate's, except under sequence parallelism: sharded over the data-parallel ranks
        only and yielding each rank's shard; See [Note: sequence parallelism under Accelerate]."""
        sp = self.sequence_parallel
        if sp.size == 1 or not isinstance(data_loader, torch.utils.data.DataLoader):
            return super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        from accelerate.data_loader import prepare_data_loader

        if device_placement is None:
            device_placement = self.device_placement
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=self.num_processes // sp.size,
            process_index=self.process_index // sp.size, split_batches=self.split_batches,
            put_on_device=device_placement, rng_types=self.rng_types.copy(), dispatch_batches=self.dispatch_batches,
            even_batches=self.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler, data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return api.sequence_parallel_loader(prepared, sp)

    def deepspeed_ulysses_dl_adapter(self, dl, model):
        """Accelerate's hook for a loader prepared apart from the model: here every prepared loader
        is already sharded (See [Note: sequence parallelism under Accelerate]), so it comes back as it is."""
        if self.sequence_parallel.size == 1 or isinstance(getattr(dl, "sp", None), api.SequenceParallelGroup):
            return dl
        raise ValueError("ZeroAccelerator.deepspeed_ulysses_dl_adapter: pass a loader returned by "
                         "accelerator.prepare(...), which under sequence parallelism yields each rank's shard")

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """Accelerate's, on the sharded loader's inner one, so the batches after the skip are still
        this rank's shards (a resumed epoch must not feed whole sequences to the split attention)."""
        if isinstance(getattr(dataloader, "sp", None), api.SequenceParallelGroup):
            return api.sequence_parallel_loader(super().skip_first_batches(dataloader.loader, num_batches), dataloader.sp)
        return super().skip_first_batches(dataloader, num_batches)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        if evaluation_mode:
            if self.is_zero_model(model):
                return model
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        return self.prepare(model, device_placement=[device_placement])

    def prepare_frozen_model(self, model: nn.Module) -> nn.Module:
        """Prepare a model that only runs forward (a DPO reference model, a distillation teacher).

        At stage 3 it is sharded in place like a trained model (1/N of its parameters per
        rank, gathered per unit in forward) with no gradients, masters or optimizer state,
        which is what DeepSpeed does for such models under ZeRO-3 (TRL's ``prepare_deepspeed``).
        At stages 1-2 sharding it would save nothing (it has no optimizer state or gradients),
        so it stays replicated, as DeepSpeed runs it at stage 0. Every process calls it.
        """
        if self.is_zero_model(model):
            return model
        if model in self._pending:
            raise ValueError("ZeroAccelerator.prepare_frozen_model: this model was prepared for training (it waits "
                             "for its optimizer); a model is either trained or frozen")
        if not plan_for(self._zero_config.stage).shards_parameters:
            return super().prepare_model(model, evaluation_mode=True)
        if not _has_meta_tensors(model):
            model = model.to(self.device)
        api.setup(model, None, self._zero_config, param_init_fn=self.param_init_fn)
        self._adopt_auto_choice(model)
        api.gather_once_in_generate(model, self.gather_once_in_generate)
        self._zero_records.append(ZeroModelRecord(model, frozen=True))
        if model not in self._models:
            self._models.append(model)
        model._is_accelerate_prepared = True
        self._compile_in_place(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        return self.prepare(optimizer, device_placement=[device_placement])

    def prepare_scheduler(self, scheduler):
        if getattr(scheduler, "_is_accelerate_prepared", False):
            if scheduler not in self._schedulers:
                self._schedulers.append(scheduler)
            return scheduler
        inner = getattr(scheduler, "optimizer", None)
        optimizer = next((o for o in self._optimizers
                          if inner is o.optimizer or inner is getattr(o.optimizer, "optimizer", None)),
                         self._optimizers)
        wrapped = AcceleratedScheduler(scheduler, optimizer, step_with_optimizer=self.step_scheduler_with_optimizer,
                                       split_batches=self.split_batches)
        wrapped._is_accelerate_prepared = True
        self._schedulers.append(wrapped)
        return wrapped

    # ------------------------------------------------------------------ training
    def backward(self, loss, **kwargs):
        """``loss / gradient_accumulation_steps``, fp16 loss scaling by the ZeroOptimizer, then backward."""
        kwargs.pop("learning_rate", None)  # LOMO's argument; LOMO optimizers are not elementwise anyway
        loss = loss / self.gradient_accumulation_steps
        scaled = [z for z in self._zero_optimizers() if z.scaler.enabled]
        if scaled:
            scaled[0].backward(loss, **kwargs)
        else:
            loss.backward(**kwargs)

    @contextlib.contextmanager
    def no_sync(self, model):
        """Inside, backward passes accumulate locally (``zero_strategy.no_sync``) for a ZeRO model."""
        if not self.is_zero_model(model):
            with super().no_sync(model):
                yield
            return
        ctx = api.no_sync(model) if self.use_distributed else contextlib.nullcontext()
        with ctx:
            yield

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model):
        """DDP-only in Accelerate; refused for a ZeRO model rather than silently not syncing."""
        if not api.is_set_up(model):
            with Accelerator.trigger_sync_in_backward(model):
                yield
            return
        raise NotImplementedError("ZeroAccelerator: trigger_sync_in_backward is not supported for ZeRO models; run "
                                  "the last backward of the step outside accelerator.no_sync (accumulate() does)")

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Global-norm clipping over every rank's shards; returns the norm before clipping."""
        params = list(parameters)
        opt = self._one_optimizer_for(params, "clip_grad_norm_")
        if opt is None:
            return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return opt.zero_optimizer.clip_grad_norm_(max_norm, norm_type)

    def _one_optimizer_for(self, params, what: str) -> ZeroAcceleratedOptimizer | None:
        """The one ZeRO optimizer ``params`` are exactly (a superset of) the parameters of; None: no ZeRO model."""
        ids = {id(p) for p in params}
        records = [r for r in self._zero_records if any(id(p) in ids for p in r.model.parameters())]
        if not records:
            return None
        opts = [o for r in records for o in r.optimizers if o.param_ids & ids]
        if len(opts) != 1 or not opts[0].param_ids <= ids:
            raise ValueError(
                f"ZeroAccelerator.{what}: gradients are clipped by one ZeRO optimizer over all of its parameters "
                "(sharded across ranks); pass model.parameters() of one prepared model (with several optimizers "
                "on it: the parameters of one optimizer, in separate calls)")
        return opts[0]

    def clip_grad_value_(self, parameters, clip_value):
        """Clamp every gradient element to ``[-clip_value, clip_value]``, on the reduced shards.

        Elementwise, so clamping each rank's shard of the averaged gradient is what DDP's
        ``clip_grad_value_`` does to the full averaged gradient. As with DDP, call it at an
        accumulation boundary (``accelerator.sync_gradients``), before ``optimizer.step()``.
        """
        params = list(parameters)
        opt = self._one_optimizer_for(params, "clip_grad_value_")
        if opt is None:
            return super().clip_grad_value_(params, clip_value)
        opt.zero_optimizer.clip_grad_value_(clip_value)

    # ------------------------------------------------------------------ weights and state
    def get_state_dict(self, model, unwrap=True):
        """Full fp32 weights (from the masters) in host memory on the main process, ``{}`` on the
        others; every rank calls it. Whole by contract, gathered group by group to the host."""
        if self.is_zero_model(model):
            return api.full_state_dict(model, rank0_only=True)
        if model in self._pending:
            return model.state_dict()
        return super().get_state_dict(model, unwrap=unwrap)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        """Stock Accelerate's files of the fp32 weights, written by the main process; every rank calls it.
        At stage 3 unit by unit; ``safe_serialization=False`` (one pickled ``.bin``) and stages 1-2
        through :meth:`get_state_dict`. See [Note: streamed save_model] in _saving.py."""
        if self.is_zero_model(model) and _saving.streams(model, safe_serialization):
            _saving.save_model_streamed(self, model, save_directory, max_shard_size)
        else:
            super().save_model(model, save_directory, max_shard_size=max_shard_size,
                               safe_serialization=safe_serialization)
        if self.is_zero_model(model):
            self.wait_for_everyone()

    def save_state(self, output_dir=None, safe_serialization=True, **save_model_func_kwargs):
        """Accelerate's state plus every rank's ZeRO shard (``zero_model*/``); resumable on any process count."""
        return _checkpointing.save_state(self, super().save_state, output_dir, safe_serialization,
                                         save_model_func_kwargs)

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        """Load what :meth:`save_state` wrote, re-sharding onto this run's processes and stage."""
        return _checkpointing.load_state(self, super().load_state, input_dir, load_kwargs, load_model_func_kwargs)

    # ------------------------------------------------------------------ lifetime
    def _teardown_all(self, keep_frozen: bool = False, keep_weights: bool | None = None) -> None:
        """``keep_weights=None``: gather the weights back only where they are not sharded (stages 1-2);
        a stage-3 model is released without gathering, as DeepSpeed leaves a ZeRO-3 model partitioned."""
        kept = [r for r in self._zero_records if keep_frozen and r.frozen and api.is_set_up(r.model)]
        for record in self._zero_records:
            if record not in kept and api.is_set_up(record.model):  # else torn down by the user already
                sharded = api.engine_of(record.model).shards_parameters
                api.teardown(record.model, keep_weights=not sharded if keep_weights is None else keep_weights)
        self._zero_records[:] = kept
        for model in self._pending:
            self._unguard(model)
        self._pending.clear()

    def free_memory(self, *objects, keep_weights: bool | None = None):
        """Tear down the ZeRO engines (hooks, shards, optimizer state) and drop Accelerate's references.

        Every process must call it. At stages 1-2 each model keeps its (whole) weights; a stage-3
        model's parameters are released, not gathered (they stay empty), since gathering the whole
        model on every rank is what sharding it avoids: save it before (``save_model``,
        ``save_pretrained``), or pass ``keep_weights=True`` to gather it back whole on every rank.
        Models from :meth:`prepare_frozen_model` stay sharded: the HF Trainer calls
        ``free_memory`` as ``train()`` starts, after a DPO trainer prepared its reference
        model (DeepSpeed's reference engine survives ``free_memory`` too). ``end_training`` or
        ``zero_strategy.teardown(model)`` releases them.
        """
        self._teardown_all(keep_frozen=True, keep_weights=keep_weights)
        return super().free_memory(*objects)

    def end_training(self, keep_weights: bool | None = None):
        """Tear down the ZeRO engines (``keep_weights``: as :meth:`free_memory`), finish trackers,
        destroy the process group."""
        self._teardown_all(keep_weights=keep_weights)
        super().end_training()


def _with_sequence_parallel(config: ZeroConfig, parallelism) -> ZeroConfig:
    """``config`` with the ``sp_size`` of ``parallelism``; a different size on both sides is refused."""
    size = getattr(parallelism, "sp_size", 1) or 1
    if size == 1:
        return config
    if config.sequence_parallel_size not in (1, size):
        raise ValueError(f"ZeroAccelerator: ParallelismConfig(sp_size={size}) and the ZeRO config's "
                         f"sequence_parallel_size={config.sequence_parallel_size} differ; set one of them (or both "
                         "to the same size)")
    return config.replace(sequence_parallel_size=size)


def _refuse_sequence_parallel_size(size: int, processes: int) -> None:
    if processes % size:
        raise ValueError(f"ZeroAccelerator: sequence parallelism of size {size} needs a multiple of {size} "
                         f"processes, but {processes} were launched; launch a multiple of {size} "
                         f"(--num_processes), or set sp_size to a divisor of {processes}")


@contextlib.contextmanager
def _launch_parallelism_off():
    """Accelerate's state built without the launch's ParallelismConfig (taken over by ZeroAccelerator)."""
    saved = os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG")
    os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
        else:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = saved


def _has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
