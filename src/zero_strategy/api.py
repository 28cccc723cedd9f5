"""Plain-PyTorch entry points: ``setup`` and the tools that work on a set-up model.

After ``model, optimizer = setup(model, optimizer, config)`` the ordinary loop
trains::

    loss = model(batch).loss          # (fp16: optimizer.backward(loss))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()

The model object is the user's own, sharded in place; no wrapper module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
import weakref
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from . import _zero_auto as _auto
from ._comm.collectives import Collectives
from ._comm.faults import failing_exception
from ._comm.hybrid import hybrid_groups
from ._comm.sequence_parallel import SequenceParallelGroup, sequence_parallel_group as _sp_group
from ._comm.sequence_parallel import sequence_parallel_groups
from ._engine import deferred_weights
from ._engine.deferred_weights import DeferredWeights, defer_weights
from ._engine.engine import ZeroEngine
from ._engine.placement import single_device
from ._model import activation_offload, expert_parallel, gather, generation, hf, quantized, saves, tiled_mlp
from ._model.activation_offload import offloaded_checkpoint
from ._model import offload_states as offload_states_impl
from ._model.gather import whole_model_pass
from ._model.install import install
from ._model.memory import MemoryReport, measure
from ._model.tiled_loss import tiled_causal_lm_loss
from ._model import sequence_parallel as _sp
from ._mechanisms.memory import release_freed_host_memory
from ._optim.layouts import layout_of
from ._optim.optimizer import OverlapStepCommitted, ZeroOptimizer
from .config import ZeroConfig

__all__ = [
    "setup", "is_set_up", "engine_of", "EngineView", "teardown", "full_shapes", "zero_grad", "reset_iter_state",
    "no_sync",
    "memory_report", "offload_states", "reload_states", "states_offloaded", "states_offloaded_for_generation",
    "comm_stats", "full_state_dict", "write_safetensors", "adapter_state_dict", "gathered_parameters",
    "gathered_units", "gathered_for_generation", "gather_once_in_generate", "modified_on_every_rank",
    "choose_preset", "tiled_causal_lm_loss", "offloaded_checkpoint", "shard_sequence", "sequence_parallel_loss",
    "sequence_parallel_loader", "sequence_parallel_group",
    # for the front ends' device meshes and data loaders: See [Note: sequence parallelism]
    "sequence_parallel_groups", "SequenceParallelGroup",
    # for the front ends' loaders (zero_strategy.transformers.from_pretrained): See [Note: weights
    # that arrive at setup] in _engine/deferred_weights.py
    "DeferredWeights", "defer_weights",
]

_log = logging.getLogger("zero_strategy")

# [Note: engine lookup without keeping models alive]
# id(model) -> engine, weakly: the model's own hooks keep its engine alive, so both
# are collected together once the user drops the model. (A WeakKeyDictionary would
# not do: its value, the engine, refers to the key, the model.) The engine holds
# the ZeroOptimizer only weakly for the same reason.
_ENGINES: "weakref.WeakValueDictionary[int, ZeroEngine]" = weakref.WeakValueDictionary()


def _lookup(model: nn.Module) -> ZeroEngine | None:
    engine = _ENGINES.get(id(model))
    return engine if engine is not None and engine.model is model else None


def setup(model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
          config: ZeroConfig | str | dict | None = None,
          process_group: dist.ProcessGroup | None = None, *,
          device: torch.device | str | None = None,
          param_init_fn: Callable[[nn.Module], object] | None = None):
    """Shard ``model`` (in place) and re-home ``optimizer`` onto fp32 master shards.

    ``optimizer`` may also be a list of optimizers over disjoint parameters of the
    model (a GAN's generator and discriminator optimizers); then a list of
    ``ZeroOptimizer`` comes back, each stepping and zeroing only its own parameters.

    ``config``: a :class:`ZeroConfig`, a preset name (``"zero3"``), a dict, or a path
    to a YAML/JSON file (ours or a DeepSpeed config). Default: ``ZeroConfig()``.
    ``"zero_auto"`` picks the least-offloaded preset whose model states fit the memory
    measured now (see :func:`choose_preset`).
    ``process_group``: the ranks to shard over (default: the whole world; a single
    process without ``torch.distributed`` initialized is a world of one).

    A model created on the meta device (``with torch.device("meta"): model = ...``) is
    materialized unit by unit on ``device`` (default: the current CUDA device, else
    the CPU), so no rank ever holds it whole; ``param_init_fn(module)`` initializes
    each module (default ``module.reset_parameters()``; see _engine/materialize.py).
    A model from ``zero_strategy.transformers.from_pretrained`` gets its pretrained
    weights here, each rank reading its own slices (See [Note: weights that arrive at setup]).

    Returns ``(model, zero_optimizer)``; ``zero_optimizer`` is ``None`` when no
    optimizer is given (inference / frozen models).
    """
    several = isinstance(optimizer, (list, tuple))
    optimizers = list(optimizer) if several else ([] if optimizer is None else [optimizer])
    cfg = ZeroConfig.load(config) if config is not None else ZeroConfig()
    if _lookup(model) is not None:
        raise ValueError("zero_strategy.setup: this model is already set up; call setup once per model "
                         "(call zero_strategy.teardown(model) first to start over)")
    for opt in optimizers:
        if isinstance(opt, ZeroOptimizer):
            raise ValueError("zero_strategy.setup was given a ZeroOptimizer: the model and optimizer are "
                             "already set up; call setup once")
        layout_of(opt, cfg)  # refuse what no layout shards before anything is set up
    pending = deferred_weights.pending_weights(model)  # See [Note: weights that arrive at setup]
    if pending and param_init_fn is None:
        param_init_fn = deferred_weights.init_for_pending(model, pending)
    sp = _sp_group(cfg.sequence_parallel_size, process_group)  # See [Note: sequence parallelism]
    undo_attention = hf.sequence_parallel_attention(model, sp) if sp.size > 1 else None
    try:
        return _setup(model, optimizers, several, cfg, process_group, device, param_init_fn, pending, sp, undo_attention)
    except BaseException:
        if undo_attention is not None:
            undo_attention()
        raise


def _setup(model, optimizers, several, cfg, process_group, device, param_init_fn, pending, sp, undo_attention):
    shard_group, replicate_group = hybrid_groups(cfg.shard_group_size, process_group)
    comm = Collectives(shard_group, wait_timeout=cfg.collective_timeout, replicate_group=replicate_group)
    cfg = _auto.resolve(model, cfg, comm, single_device(model, device))  # zero_auto: See [Note: zero_auto]
    owned = frozenset(k for k, opt in enumerate(optimizers) if layout_of(opt, cfg) == "owned")
    hf.tiled_loss_targets(model, cfg.tiled_loss)  # refuse a model the tiled loss cannot serve before sharding it
    activation_offload.refuse_without_checkpointing_layers(model, cfg.activation_offload)
    tiled_mlp.tiled_mlp_targets(model, cfg.tiled_mlp)
    quantized.refuse_unsupported(model)  # See [Note: packed 4-bit parameters under ZeRO] in _model/quantized.py
    if cfg.expert_parallel_size > 1:  # See [Note: expert parallelism] in _model/expert_parallel.py
        expert_parallel.refuse_expert_parallel(cfg, comm.world_size)
    _sync_module_states(model, comm)
    ep = (expert_parallel.apply_expert_parallel(model, optimizers, cfg.expert_parallel_size, process_group, comm)
          if cfg.expert_parallel_size > 1 else None)
    try:
        result = _setup_engine(model, optimizers, several, cfg, comm, owned, device, param_init_fn, pending, sp,
                               undo_attention, ep)
    except BaseException:
        if ep is not None:  # the model's own experts modules and the optimizers' parameters back
            ep.roll_back(optimizers)
        raise
    if ep is not None:
        ep.drop_whole()  # each rank keeps only its experts from here on
    return result


def _setup_engine(model, optimizers, several, cfg, comm, owned, device, param_init_fn, pending, sp, undo_attention,
                  ep):
    group_of = _optimizer_group_of(model, optimizers)
    kept = {**hf.kept_dtypes(model, cfg.compute_dtype), **quantized.kept_dtypes(model)}
    opaque = frozenset(quantized.kept_dtypes(model))
    engine = ZeroEngine(model, cfg, comm, group_of, device=device, param_init_fn=param_init_fn,
                        owned_optimizers=owned, kept_dtypes=kept,
                        loaded_later=deferred_weights.loaded_whole(model, pending, opaque), opaque=opaque,
                        rank_local=ep.local_ids if ep is not None else frozenset())
    quantized.place_states(model, engine.device)  # a base from the one-call loader: its states were made on the CPU
    engine.expert_parallel = ep  # before install: generate() is shadowed for its all-to-alls
    engine.undo_on_teardown = install(model, engine, end=lambda: teardown(model))  # the one undo list of teardown
    engine.sequence_parallel = sp
    if ep is not None:
        engine.undo_on_teardown.append(ep.undo)
        engine.undo_on_teardown.append(ep.release_groups)  # the groups made for it, once nothing uses them
    if undo_attention is not None:
        engine.undo_on_teardown.append(undo_attention)
    _ENGINES[id(model)] = engine
    steppers = [ep.stepper(opt) if ep is not None else None for opt in optimizers]  # before the re-homing
    zero_opts = [ZeroOptimizer(opt, engine, index=k) for k, opt in enumerate(optimizers)]
    for zopt, stepper in zip(zero_opts, steppers):
        zopt.rank_local = stepper
    engine.optimizer_refs = [weakref.ref(z) for z in zero_opts]
    deferred_weights.load_deferred_weights(model)
    if cfg.release_host_memory:  # what materializing and reading the weights freed: See [Note: releases where a phase ends]
        release_freed_host_memory()
    if several:
        return model, zero_opts
    return model, (zero_opts[0] if zero_opts else None)


def _sequence_parallel_of(model) -> SequenceParallelGroup:
    """``model``'s SP group; a :class:`SequenceParallelGroup` given instead is itself (a front end
    prepares data loaders before the model they feed)."""
    if isinstance(model, SequenceParallelGroup):
        return model
    engine = _engine_of(model)
    return engine.sequence_parallel or SequenceParallelGroup(None, 0, 1)


def _pad_token_id(model) -> int:
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return pad if isinstance(pad, int) else 0


def sequence_parallel_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group of ``model``'s sequence-parallel group (the ranks sharing its samples);
    None without sequence parallelism. See [Note: sequence parallelism] in _model/sequence_parallel.py."""
    return _sequence_parallel_of(model).group


def shard_sequence(batch, model: nn.Module) -> dict:
    """This rank's shard of a whole-sample batch for ``model`` set up with ``sequence_parallel_size=N``.

    Every rank of an SP group passes the same batch (``input_ids``, ``labels``, optional
    ``position_ids`` / right-padding ``attention_mask``); it gets its 1/N of the sequence
    with global ``position_ids`` and ``shift_labels`` (DeepSpeed's
    ``UlyssesSPDataLoaderAdapter`` gives the same keys). Without sequence parallelism the
    batch comes back with ``shift_labels`` and ``position_ids`` added, so one loop serves
    both. Compute the loss with :func:`sequence_parallel_loss`."""
    return _sp.shard_batch(batch, _sequence_parallel_of(model), _pad_token_id(model))


def sequence_parallel_loader(loader, model: nn.Module) -> "_sp.SequenceShardedLoader":
    """``loader`` (yielding whole samples, the same on every rank of an SP group: shard the
    data over ``world // N`` replicas, ``rank // N``) yielding :func:`shard_sequence` shards."""
    return _sp.SequenceShardedLoader(loader, _sequence_parallel_of(model), _pad_token_id(model))


def sequence_parallel_loss(loss: torch.Tensor, shift_labels: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """The whole sample's loss on every rank of the SP group, from this shard's mean token
    ``loss`` (``model.loss_function(logits=..., labels=None, shift_labels=..., vocab_size=...)``);
    back-propagate it on every rank. A shard whose labels are all -100 adds zero, not NaN.
    See [Note: sequence parallelism] in _model/sequence_parallel.py for the gradient arithmetic."""
    return _sp.sequence_parallel_loss(loss, shift_labels, _sequence_parallel_of(model))


def _optimizer_group_of(model: nn.Module, optimizers: list) -> dict[int, tuple[int, int]]:
    """id(param) -> (index of its optimizer, index of its param group there)."""
    in_model = {id(p) for p in model.parameters()}
    group_of: dict[int, tuple[int, int]] = {}
    for k, optimizer in enumerate(optimizers):
        for i, pg in enumerate(optimizer.param_groups):
            for p in pg["params"]:
                if id(p) not in in_model:
                    raise ValueError(
                        f"zero_strategy.setup: optimizer param group {i} holds a parameter of shape "
                        f"{tuple(p.shape)} that is not in the model; build the optimizer from this model's "
                        "parameters")
                if id(p) in group_of and group_of[id(p)][0] != k:
                    raise ValueError(
                        f"zero_strategy.setup: a parameter of shape {tuple(p.shape)} is in optimizers "
                        f"{group_of[id(p)][0]} and {k}; give each parameter to one optimizer")
                group_of[id(p)] = (k, i)
    return group_of


#: bytes of small tensors broadcast as one at setup (a bigger tensor is broadcast alone, in place)
SYNC_BUCKET_BYTES = 16 * 2**20


def _sync_module_states(model: nn.Module, comm: Collectives) -> None:
    """Start every rank from rank 0's parameters and buffers, as DDP does.

    Tensors smaller than ``SYNC_BUCKET_BYTES`` go in buckets of up to that many bytes, one
    broadcast each, as DDP's ``_sync_module_states`` coalesces them: one broadcast per
    tensor cost ~0.7 ms on gloo, 7.5 s of a 10,000-parameter model's 9.6 s setup
    (benchmarks/setup_bench.py). A bucket is at most that much extra memory."""
    if comm.world_size == 1:
        return
    tensors = [t.data for t in list(model.parameters()) + list(model.buffers())
               if not t.is_meta]  # meta tensors are broadcast when materialized, unit by unit
    buckets: dict[tuple, tuple[list[torch.Tensor], list[int]]] = {}  # (dtype, device) -> (tensors, [bytes])
    with torch.no_grad():
        for t in tensors:
            size = t.numel() * t.element_size()
            if size >= SYNC_BUCKET_BYTES:
                comm.broadcast(t, src_rank=0, label="initial weights")
                continue
            bucket, held = buckets.setdefault((t.dtype, t.device), ([], [0]))
            if held[0] + size > SYNC_BUCKET_BYTES:
                _broadcast_bucket(bucket, comm)
                bucket.clear()
                held[0] = 0
            bucket.append(t)
            held[0] += size
        for bucket, _ in buckets.values():
            if bucket:
                _broadcast_bucket(bucket, comm)


def _broadcast_bucket(tensors: list[torch.Tensor], comm: Collectives) -> None:
    """Broadcast ``tensors`` (one dtype and device) from rank 0 as one flat tensor, then copy back."""
    if len(tensors) == 1:
        comm.broadcast(tensors[0], src_rank=0, label="initial weights")
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])  # [sum of numels]
    comm.broadcast(flat, src_rank=0, label="initial weights")
    torch._foreach_copy_(tensors, [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)])


def is_set_up(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by a live engine (``setup`` and no ``teardown`` since)."""
    return _lookup(model) is not None


def _engine_of(model: nn.Module) -> ZeroEngine:
    """The engine itself: for this module, the checkpoint package and tests, never handed to users."""
    engine = _lookup(model)
    if engine is None:
        raise ValueError("this model was not set up with zero_strategy.setup(model, optimizer, config)")
    return engine


class EngineView:
    """What ``setup`` made of a model, read-only: the public face of its engine (``engine_of``).

    One view per setup: ``engine_of(model)`` returns the same object until ``teardown``, so
    ``engine_of(model) is view`` says whether ``model`` is still set up by the same call. The view
    holds the engine weakly: keeping a view does not keep a dropped model's memory alive.
    """

    __slots__ = ("_engine", "__weakref__")

    def __init__(self, engine: ZeroEngine):
        self._engine = weakref.ref(engine)

    def _live(self) -> ZeroEngine:
        engine = self._engine()
        if engine is None:
            raise ValueError("zero_strategy: the model of this EngineView was dropped")
        return engine

    @property
    def config(self) -> ZeroConfig:
        """The config the model runs with: presets, files and ``"zero_auto"`` resolved."""
        return self._live().config

    @property
    def shards_parameters(self) -> bool:
        """Whether parameters rest as shards between uses (stage 3): a rank holds no whole weight."""
        return self._live().plan.shards_parameters

    def after_save_succeeds(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the saving thread once the asynchronous save of this model now writing has
        succeeded (never if it fails), and return True; return False, ``fn`` not run, when none is
        writing. Pruning an old checkpoint this way never loses it to a failed save."""
        return self._live().background_save.after_success(fn)


#: engine -> its one view, weakly on both sides (the view refers to the engine weakly)
_VIEWS: "weakref.WeakKeyDictionary[ZeroEngine, EngineView]" = weakref.WeakKeyDictionary()


def engine_of(model: nn.Module) -> EngineView:
    """The :class:`EngineView` of a set-up model: its resolved config, whether its parameters are
    sharded. ``ValueError`` when ``model`` is not set up."""
    engine = _engine_of(model)
    view = _VIEWS.get(engine)
    if view is None:
        view = _VIEWS[engine] = EngineView(engine)
    return view


def teardown(model: nn.Module, keep_weights: bool = True, *, error: BaseException | None = None) -> None:
    """Undo ``setup``: remove hooks, free shards, gradients and offload/NVMe buffers.

    ``keep_weights=True`` first gathers the full weights so the model is a plain,
    usable module again (every rank holds the whole model afterwards).
    ``keep_weights=False`` only releases: no gathering, so it is safe for models too
    big for one rank; stage-3 parameters stay empty. Every rank must call it.

    [Note: no collective on the error path]
    Teardown while an exception is being handled (inside an ``except`` block: Lightning's
    and Accelerate's clean-up after a failed step), after a collective of this engine
    failed, or in the middle of an iteration never gathers, whatever ``keep_weights``
    says: the other ranks are waiting in a different collective (or are gone), so a
    gather here would hang this rank until the timeout and hide the real error. It
    tells the other ranks why this rank leaves instead (their error message quotes it)
    and releases like ``keep_weights=False``. ``error``: the exception that ended training,
    for a caller that tears down outside its ``except`` block (a front end's teardown).
    """
    engine = _engine_of(model)
    failing = error if error is not None else failing_exception()
    # an asynchronous save still writing finishes first; its failure is raised once the model is
    # released below (on the error path it is logged: the error being handled comes first)
    save_error = engine.background_save.wait(raise_error=False)
    if save_error is not None and failing is not None:
        _log.error("zero_strategy: an asynchronous checkpoint save failed: %s", save_error)
        save_error = None
    if failing is not None or engine.comm.failed or not engine.is_idle:
        why = (f"raised {type(failing).__name__}: {str(failing)[:300]}" if failing is not None
               else "tore down after a failed collective or in the middle of an iteration")
        engine.comm.report_failure(f"rank {engine.comm.rank} {why}")
        if keep_weights and engine.plan.shards_parameters:
            warnings.warn("zero_strategy.teardown on the error path does not gather the weights (see "
                          "[Note: no collective on the error path]); the stage-3 parameters stay empty",
                          stacklevel=2)
        keep_weights = False
    if not keep_weights and engine.expert_parallel is not None:
        empty = [n for n, p in model.named_parameters() if id(p) in engine.expert_parallel.local_ids]
        warnings.warn(f"zero_strategy.teardown without gathering the weights ({_why_empty(failing, engine)}) leaves "
                      f"expert parallelism's experts empty (0 elements): {', '.join(empty)}; each rank held only its "
                      "own experts. Call zero_strategy.teardown(model) (keep_weights=True) on every rank, outside "
                      "an error, to get the whole experts back, or save them first (zero_strategy.full_state_dict, "
                      "save_pretrained, save_checkpoint)", stacklevel=2)
    offload_states_impl.reload(engine, non_blocking=False)  # local: safe on the error path too
    full = full_state_dict(model) if keep_weights else {}
    # each parameter back in the dtype its group computes in: a kept fp32 weight stays fp32, a 4-bit
    # base's packed codes keep their storage dtype (See [Note: packed 4-bit parameters under ZeRO])
    dtype_of = {id(slot.param): g.compute_dtype for g, slot in engine.managed.values()}
    engine.ended = engine.ended or "zero_strategy.teardown(model) released it"
    engine.remove_hooks()
    for undo in engine.undo_on_teardown:
        undo()
    _ENGINES.pop(id(model), None)
    for zopt in engine.optimizers():
        zopt.optimizer.state.clear()
    for g in engine.groups:
        g.free()
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=True):
            if name in full:
                p.data = full[name].to(engine.device, dtype_of.get(id(p), engine.compute_dtype))  # full_state_dict: on the host
    if save_error is not None:
        raise save_error


def _why_empty(failing, engine) -> str:
    """Why a teardown does not gather: for its warning."""
    if failing is not None or engine.comm.failed or not engine.is_idle:
        return "on the error path, see [Note: no collective on the error path]"
    return "keep_weights=False"


def full_shapes(model: nn.Module) -> dict[nn.Parameter, torch.Size]:
    """Each managed parameter's unsharded shape (stage-3 parameters are empty at rest)."""
    return {slot.param: slot.shape for _, slot in _engine_of(model).managed.values()}


def zero_grad(model: nn.Module) -> None:
    """Drop every gradient shard of the model (all its optimizers' groups) now.

    ``model.zero_grad()``, ``submodule.zero_grad()`` and ``optimizer.zero_grad()`` work
    too (see [Note: param.grad after backward] in _engine/gradients.py); this one frees the
    gradient memory at once instead of when the next gradient arrives. With ``overlap_step``
    it refuses a backward's gradients dropped before ``step()`` as ``optimizer.zero_grad()``
    does (See [Note: a step overlap_step began is not undone] in _optim/optimizer.py).
    """
    engine = _engine_of(model)
    committed = None
    for zopt in engine.optimizers():  # each completes the step its groups began, if any, first
        try:
            zopt.zero_grad()
        except OverlapStepCommitted as err:
            committed = committed or err
    engine.zero_grad()
    if committed is not None:
        raise committed


def reset_iter_state(model: nn.Module) -> None:
    """Return the engine to idle after an iteration that an exception interrupted.

    Called automatically by the next forward, ``zero_grad`` or ``step``, so a retry loop
    (``try: ... except torch.OutOfMemoryError: optimizer.zero_grad()``) needs nothing
    more; call it yourself before anything else that would touch the model, e.g. a
    second ``backward()`` on a retained graph after the first one raised. Every rank
    must call it (it waits for collectives already in flight). Like FSDP2's
    ``FSDPModule.reset_iter_state``.
    """
    _engine_of(model).reset_iter_state()


def no_sync(model: nn.Module):
    """Context manager: backward passes inside accumulate gradients locally, no communication.

    Stage 1 always reduces once per step and ignores it; stages 2-3 keep a full
    gradient buffer per unit until the first backward outside the context.
    """
    return _engine_of(model).no_sync()


def memory_report(model: nn.Module, reset_peak: bool = False) -> MemoryReport:
    """Model-state bytes this rank holds now (params, grads, master, optimizer state), and
    its working set (gathered units, gradient buffers, staging) now and at its peak.

    ``reset_peak=True``: after measuring, the peaks start again from now, so the next
    report's peak is the next phase's (as ``torch.cuda.reset_peak_memory_stats``).
    """
    engine = _engine_of(model)
    report = measure(engine, engine.optimizers())
    if reset_peak:
        engine.transfers.working_set.reset_peak()
    return report


def _optimizers_of(engine: ZeroEngine, optimizer, where: str) -> list:
    """``optimizer`` (None: all of the model's; one or a list of those ``setup`` returned) as a list."""
    mine = engine.optimizers()
    if optimizer is None:
        return mine
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in given:
        if not any(opt is z or opt is z.optimizer for z in mine):
            raise ValueError(f"{where}: {type(opt).__name__} is not an optimizer setup() returned for this "
                             "model; pass the one(s) from model, optimizer = zero_strategy.setup(...), or None")
    return [z for z in mine if any(opt is z or opt is z.optimizer for opt in given)]


def offload_states(model: nn.Module, optimizer=None, include=None, device: str = "cpu",
                   pin_memory: bool = True, non_blocking: bool = False) -> None:
    """Move the model's training state off the compute device into host memory, until
    :func:`reload_states`: DeepSpeed's ``engine.offload_states(include=..., device=..., pin_memory=...,
    non_blocking=...)`` for a set-up model (a rollout phase hands the GPU to generation or vLLM).

    ``include``: the kinds to move (default: all), by DeepSpeed's ``OffloadStateTypeEnum`` names,
    members or strings (``optim_states``, ``hp_params`` fp32 masters, ``lp_params`` compute-dtype
    parameters, ``lp_grads`` reduced gradient shards, ``contiguous_grad_buffer`` full gradient
    buffers) or ours (``optimizer_state``, ``master``, ``params``, ``grads``). ``optimizer``: whose
    masters, optimizer state and gradients move (default: every optimizer setup returned for the
    model); the parameters are the model's. What an offload policy already keeps on the host or
    on NVMe stays there (nothing to move), and kinds already offloaded are skipped, so a second
    call is a no-op. Until ``reload_states`` the model refuses what needs the moved state
    (forward with ``lp_params`` off; backward, ``zero_grad`` with gradients off; ``step``,
    checkpoints and state dicts), naming ``reload_states``. Exact: the bytes come back unchanged.
    ``non_blocking=True`` with pinned memory leaves the copies queued on the current CUDA stream.
    Local to each rank (no collective). See [Note: what offload_states moves] in _model/offload_states.py.
    """
    engine = _engine_of(model)
    if str(getattr(device, "value", device)).lower() != "cpu":
        raise ValueError(f"zero_strategy.offload_states: device={device!r} is not supported; states move to "
                         "host memory (device='cpu'); NVMe offload is a config policy (offload_optimizer=NVMeOffload)")
    offload_states_impl.offload(engine, _optimizers_of(engine, optimizer, "zero_strategy.offload_states"),
                                include, pin_memory=pin_memory, non_blocking=non_blocking)


def reload_states(model: nn.Module, optimizer=None, non_blocking: bool = False) -> None:
    """Bring back everything :func:`offload_states` moved for this model, bit for bit (DeepSpeed's
    ``engine.reload_states()``); a no-op when nothing is offloaded. ``optimizer`` is checked to
    belong to the model; the model's whole offloaded state comes back in any case."""
    engine = _engine_of(model)
    _optimizers_of(engine, optimizer, "zero_strategy.reload_states")
    offload_states_impl.reload(engine, non_blocking=non_blocking)


def states_offloaded(model: nn.Module, optimizer=None, include=None, *, pin_memory: bool = True,
                     non_blocking: bool = False) -> contextlib.AbstractContextManager:
    """Context: :func:`offload_states` on entry, :func:`reload_states` on exit (also when the block
    raises). For a rollout phase: ``with zs.states_offloaded(model, include=["optim_states", ...]):
    outputs = model.generate(...)``. When states were offloaded before the block already, it leaves
    them, and what it added, offloaded (``reload_states`` brings everything back)."""
    engine = _engine_of(model)
    return offload_states_impl.offloaded(engine, _optimizers_of(engine, optimizer, "zero_strategy.states_offloaded"),
                                         include, pin_memory=pin_memory, non_blocking=non_blocking)


def states_offloaded_for_generation(model: nn.Module) -> contextlib.AbstractContextManager:
    """What a generation phase runs in: :func:`states_offloaded` with the kinds of
    ``ZeroConfig(offload_states_during_generation=...)``, or nothing when it is off. Every
    ``generate()`` of a set-up model runs in it by itself; this is for other rollout code."""
    return offload_states_impl.offloaded_for_generation(_engine_of(model))


def comm_stats(model: nn.Module) -> dict:
    """What this rank communicated during the last ``optimizer.step()`` cycle (see _collectives)."""
    return _engine_of(model).last_step_comm


@torch.no_grad()
def full_state_dict(model: nn.Module, rank0_only: bool = False,
                    dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """Full, unsharded weights (from the fp32 masters) plus buffers, keyed like ``model.state_dict()``,
    in host memory.

    Every rank must call it (it gathers group by group). Each group's gathered values
    go to the host before the next group is gathered, so the compute device holds one
    group beyond its shards at any time (a 13B model's fp32 weights are 52 GB: never on
    one GPU). With ``rank0_only`` the other ranks send their shards to rank 0, keep nothing
    and return ``{}``; on gloo rank 0 receives them straight into the tensors it returns.
    ``dtype=None`` keeps each tensor's stored dtype.
    """
    engine = _engine_of(model)
    with whole_model_pass(engine):  # See [Note: releases where a phase ends]
        return gather.full_state_dict(engine, rank0_only, dtype)


@torch.no_grad()
def write_safetensors(model: nn.Module, directory: str | os.PathLike, file_of: dict[str, str], files: Sequence[str],
                      *, write: bool, dtype: torch.dtype | None = torch.float32) -> None:
    """Write entries of ``model.state_dict()`` into safetensors files, gathering unit by unit.

    ``file_of``: state-dict name -> file name in ``directory`` (every name in it is written,
    the others not); ``files``: every file to write (one no name falls in is written empty).
    Every rank calls it; the rank with ``write=True`` writes, holding one unit's host copies,
    the others send their shards to it and keep nothing; the device holds one group beyond
    its shards. Floating tensors in ``dtype`` (fp32: from the masters where a group trains,
    as :func:`full_state_dict`; None: the compute dtype), the others as stored. For the front
    ends' saves (See [Note: streamed save_model] in accelerate/_saving.py).
    """
    engine = _engine_of(model)
    with whole_model_pass(engine):  # See [Note: releases where a phase ends]
        saves.write_files(engine, os.fspath(directory), dict(file_of), list(files), write, dtype,
                                   "write_safetensors")


@torch.no_grad()
def adapter_state_dict(model: nn.Module, adapters: Sequence[str] | None = None, save_embedding_layers="auto",
                       dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """Host copies of the entries of a PEFT model's ``state_dict()`` its adapter save can keep
    (weights under a module named after one of ``adapters``, trainable parameters, the embedding
    layers where ``save_embedding_layers`` may keep them, buffers), gathering only the units
    holding them; every rank calls it and gets them. Given to ``save_pretrained(state_dict=...)``
    it writes what the save of the whole ``state_dict()`` would (PEFT filters it the same way).
    See [Note: streamed adapter saves] in _model/hf.py.
    """
    return hf.adapter_values(_engine_of(model), list(adapters) if adapters else None,
                             save_embedding_layers, dtype, "adapter_state_dict")


@contextlib.contextmanager
def gathered_parameters(model: nn.Module, params: Iterable[nn.Parameter] | None = None,
                        modifier_rank: int | None = None) -> Iterator[None]:
    """Materialize full parameters inside the block (stage 3), then re-shard.

    ``params``: only the groups holding these (default: all). ``modifier_rank``: if
    given, changes that rank makes to the gathered parameters are broadcast to all
    ranks and written into the fp32 masters on exit; otherwise changes are discarded
    (stage 3) and must not be made. Every rank must enter the context.
    """
    with gather.gathered_parameters(_engine_of(model), params, modifier_rank):
        yield


def gathered_units(model: nn.Module, named: Iterable[tuple[str, nn.Parameter]] | None = None
                   ) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """``(name, parameter)`` pairs (default: ``model.named_parameters()``) one unit at a time, each
    list yielded while its unit is gathered (stage 3: the parameters hold their full values), then
    the parameters the engine does not hold as one last list. For a consumer that streams the whole
    model's current weights (the vLLM weight sync), holding one unit beyond the shards. Every rank
    must iterate to the end (each unit is an all-gather)."""
    yield from gather.gathered_units(_engine_of(model), model.named_parameters() if named is None else named)


def gathered_for_generation(model: nn.Module, budget_bytes: int | None = None):
    """Context: at stage 3 every unit stays gathered for the block, for a whole ``generate()``.

    ::

        with torch.no_grad(), zero_strategy.gathered_for_generation(model):
            out = model.generate(**inputs)

    One all-gather per unit on entry instead of one per unit per new token; released at
    exit (also when the block raises). Read-only and for no-grad forwards: a parameter
    written in place raises at exit, a forward with gradients enabled raises at once.
    ``budget_bytes``: the most this rank may hold gathered; when the whole model's
    parameters exceed it on some rank, the block gathers per unit as training does (one
    log line). Default: 3/4 of the free device memory (CPU: of the host memory available
    to this rank). A no-op at stages 1-2. Every rank must enter it. See [Note: gathered
    for generation] in _model/generation.py.
    """
    return generation.gathered_for_generation(_engine_of(model), budget_bytes)


def gather_once_in_generate(model: nn.Module, enabled: bool = True, budget_bytes: int | None = None) -> None:
    """Make every later ``generate()`` of the model's transformers modules run inside
    :func:`gathered_for_generation` (``enabled=False``: gather per unit again, the default).

    ``zero_trainer(...)`` turns it on for the trainer's models unless the trainer's arguments
    say ``ds3_gather_for_generation=False`` (TRL's switch for DeepSpeed ZeRO-3).
    """
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError(f"gather_once_in_generate: budget_bytes={budget_bytes} must be >= 0 (or None: measured)")
    policy = _engine_of(model).generation
    policy.once_in_generate, policy.budget_bytes = bool(enabled), budget_bytes


@contextlib.contextmanager
def modified_on_every_rank(model: nn.Module, params: Iterable[nn.Parameter] | None = None) -> Iterator[None]:
    """Like ``gathered_parameters(modifier_rank=...)`` for a change every rank makes identically
    (a deterministic merge of adapters): each rank writes its own slice back, nothing is broadcast.

    Front ends use it around library calls that rewrite weights in place (PEFT's merges).
    """
    with gather.modified_on_every_rank(_engine_of(model), params):
        yield


def choose_preset(model: nn.Module, config: ZeroConfig | str | dict = "zero_auto", *, world_size: int | None = None,
                  available: "_auto.AvailableMemory | None" = None, headroom: float = _auto.HEADROOM,
                  activations: int = 0, seq_len: int | None = None, batch_size: int = 1) -> ZeroConfig:
    """The config ``zero_auto`` would choose for ``model`` (materialised or on the meta device).

    ``available``: per-rank memory to plan for (an :class:`AvailableMemory`); default:
    measured in this process alone (no collective, so one rank may call it), host memory and
    NVMe space divided by ``LOCAL_WORLD_SIZE`` (set by torchrun) when set; ``setup`` instead
    takes the minimum over the ranks. ``world_size``: ranks to plan for
    (default: the initialised process group's, else 1). Logs the table of candidates;
    raises ``MemoryError`` saying how much more host memory or NVMe space would make one
    fit when none does. ``activations``: activation bytes per rank to count on the device beside
    the model states (``estimate_activations(...).peak_with_checkpointing``; the tiled loss and
    checkpointing lower it), so a long sequence can tip the choice toward more sharding or offload.
    ``seq_len`` (with ``batch_size`` sequences per rank; a Llama-style transformers model): estimate
    the activations per candidate instead, at the config's ``sequence_parallel_size`` and tiling, and
    where they do not fit add the tiled loss, the tiled MLP and activation offload (with
    checkpointing, on a GPU) before moving to the next preset; the sequence-parallel degree is never
    changed, but the error names one that would fit. Without ``seq_len``, the config's own
    (``ZeroConfig(seq_len=...)``, as setup reads it). See [Note: zero_auto] in _zero_auto.py.
    """
    cfg = ZeroConfig.load(config).replace(auto=True, offload_optimizer=None, offload_params=None)
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if available is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        available = _auto.measure_local(single_device(model, None), cfg, max(1, local_ranks))
    if seq_len is None and cfg.seq_len is not None:  # the config's shape, as setup reads it
        seq_len, batch_size = cfg.seq_len, cfg.batch_size
    workload = None
    if seq_len is not None:
        if activations:
            raise ValueError("choose_preset: pass activations= (bytes) or seq_len= (estimated), not both")
        workload = _auto.Workload.of(model, seq_len, batch_size)
    return _auto.choose(model, cfg, world_size, available, headroom=headroom, activations=activations,
                        workload=workload)
