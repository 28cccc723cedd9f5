"""The user's optimizer, re-homed onto fp32 master shards, and the fp16 loss scale its step keeps.

[Note: why re-home instead of wrap]
``setup`` keeps the user's optimizer object and replaces the ``params`` of each of
its param groups with the master shards (1-D fp32 tensors, one per flat group) of
the parameters that group held. Hyperparameters, per-group settings and anything
that holds the param-group dicts (LR schedulers) keep working, and the update is
the user's own optimizer code (fused/foreach kernels included). This is exact
only for *elementwise* optimizers, where each element's update depends on that
element alone.

[Note: the order inside ``step()``]
1. make gradient shards final (stage 1 reduce-scatters here; stages 2-3 only wait);
2. build each master's fp32 ``.grad`` (aliasing the shard when already fp32),
   unscale fp16 gradients and check for inf/nan on every rank (one all-reduce);
3. clip by the global norm if configured (one all-reduce);
4. the user's optimizer steps the master shards; 5. masters are copied into the
   parameters and all-gathered where parameters are replicated (stages 1-2).
An fp16 overflow anywhere skips steps 3-5 on every rank and backs off the scale.

[Note: hooks fire once per step]
The user may hold either object: the ZeroOptimizer ``setup`` returned, or their own
optimizer (hooks registered before setup, an LR scheduler built on it). Step hooks
on either, and torch's global optimizer hooks, fire exactly once per ``step()``, on
the calling thread. Internally the user's optimizer steps once per call (device) or
once per group on the CPU worker (offload) through its *unhooked* step function, and
``step()`` fires the user's optimizer's hooks around the whole step itself.

The offloaded step (CPU/NVMe masters, and overlap_step) is its own pipeline: offloaded_step.py.

[Note: a step overlap_step began is not undone]
With ``overlap_step=True`` each group's CPU step begins as soon as a synced backward
reduces it (See [Note: overlap_step] in offloaded_step.py): when backward returns, the
masters and optimizer state (AdamW's moments and step count) already hold the new
values, and each rank's own parameter shard is being uploaded; ``step()`` only waits
and all-gathers. An optimizer step cannot be inverted, and keeping the old values to
put back would hold the masters and optimizer state twice in host memory (12 bytes per
parameter for AdamW), the memory offload exists to save. So a synced backward commits
the step, and each habit that would take it back raises at once, never keeping half
of it silently:

* ``zero_grad()`` before ``step()`` (a batch skipped after its backward, the retry
  after a backward that raised): completes the group steps that began (uploads and
  all-gathers them, so every rank holds the same parameters), drops the gradients,
  then raises :class:`OverlapStepCommitted`. The model and optimizer state are then
  as after ``step()`` for the groups that stepped (every group after a whole backward;
  after a backward that raised, those reduced before it); the step hooks did not run
  and an LR scheduler did not count it.
* ``step()`` after the gradients of a group that stepped were cleared or zeroed
  (``model.zero_grad()``, ``p.grad = None``): the same, with the gradients backward
  left (not the cleared ones), then raises.
* a forward before ``step()`` (the next batch after ``model.zero_grad()``): raises
  before the forward and changes nothing; ``step()`` completes the step (engine.py).
* a second synced backward before ``step()``: refused at its first gradient (engine.py).
* clipping: refused (``clip_grad_norm_``/``clip_grad_value_``, and by the config).

To drop a batch under ``overlap_step``, decide before its backward (skip the backward),
or run a backward that may be dropped inside ``no_sync()``: nothing steps during it.

**The fp16 loss scale** (:class:`LossScaler`): grows after a run of good steps, backs off after overflows.

Used only with ``precision="fp16"``: the optimizer checks the unscaled gradients for
inf/nan on every rank (one all-reduce) and skips the step on all of them when any
overflowed (See [Note: the order inside ``step()``] above). The scale backs
off after ``hysteresis`` overflows (DeepSpeed's meaning, see ``LossScaleConfig``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from .._engine.engine import ZeroEngine, refuse_while_offloaded
from .._engine.gradients import keep_untouched
from .._engine.units import publish_masters
from .._mechanisms.cast_scratch import carve
from .._mechanisms.transfers import device_step_batches
from .layouts import layout_of
from .offloaded_step import OffloadedStep
from .owned_runs import owned_state, shared_tensors


class ZeroOptimizer(torch.optim.Optimizer):
    """The optimizer ``setup`` returns: the user's optimizer stepping master shards.

    It *is* a ``torch.optim.Optimizer`` sharing ``param_groups``/``state`` with the
    user's object, so LR schedulers built on either work.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine: ZeroEngine, index: int = 0):
        """``index``: which of the optimizers given to ``setup`` this is (several: e.g. a GAN)."""
        layout_of(optimizer, engine.config)
        if len(optimizer.state) > 0:
            raise ValueError(
                "zero_strategy.setup: the optimizer has already stepped (its state is keyed by the "
                "unsharded parameters); call setup() before the first optimizer.step(), or load the "
                "state afterwards through zero_strategy checkpoints")
        self.optimizer = optimizer
        self.engine = engine
        self.config = engine.config
        self.index = index
        #: the flat groups this optimizer steps (all trainable groups when it is the only one)
        self.groups = [g for g in engine.trainable_groups if g.optimizer_index == index]
        by_group: dict[int, list] = {i: [] for i in range(len(optimizer.param_groups))}
        #: id(group) -> (slot, where in the shard, the view the optimizer steps): See [Note: optimizers
        #: that need whole tensors] in _optim/layouts.py
        self._views: dict[int, list[tuple[Any, slice, torch.nn.Parameter]]] = {}
        for g in self.groups:
            if g.owned:  # views of the master, which follow it in and out of an NVMe swap file
                empty = torch.empty(0, dtype=g.master.dtype, device=g.master.device)
                views = [(s, where, torch.nn.Parameter(empty.clone())) for s, where in g.owned_slots()]
                g.masters.attach_views([(v, where, s.shape) for s, where, v in views])
                self._views[id(g)] = views
                by_group[g.optimizer_group].extend(v for _, _, v in views)
            else:
                by_group[g.optimizer_group].append(g.master)
        for i, pg in enumerate(optimizer.param_groups):
            pg["params"] = by_group[i]
        # the attributes torch.optim.Optimizer's machinery (hooks, schedulers) looks for
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._optimizer_step_pre_hooks: dict = OrderedDict()
        self._optimizer_step_post_hooks: dict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict = OrderedDict()
        self._patch_step_function()  # torch's step-hook wrapper, as Optimizer.__init__ would install
        self._unhooked_step = _unhooked_step_of(optimizer)
        # the user's own object stepped directly would step masters without gradients: a silent
        # no-op. Its hooked step() refuses instead (internal steps bypass hooks).
        self._internal_steps = 0  # the engine's own calls of the user's step in progress (any thread)
        self._guard = optimizer.register_step_pre_hook(self._refuse_direct_step)
        self.offloaded = OffloadedStep(engine, self.groups, self._step_masters, lambda: self.optimizer.state,
                                       self._set_grad, self.swappable_state, self.owned_views,
                                       lambda: self.optimizer)
        self.scaler = LossScaler(self.config.loss_scale, enabled=self.config.precision == "fp16")
        self._prepared = False
        self._found_inf = False
        self._scaled_backward = False
        self._factor: float | torch.Tensor = 1.0
        self.last_grad_norm: torch.Tensor | None = None
        self.skipped_steps = 0
        #: parameters each rank holds whole and alone, with their own step (``.grads()``, ``.step(factor)``,
        #: ``.zero_grad()``): expert parallelism's experts, set by setup (See [Note: expert parallelism]
        #: in _model/expert_parallel.py); None: none
        self.rank_local = None

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.engine.plan.stage}, {self.optimizer!r})"

    # -------------------------------------------------------------- loss scale
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (unchanged for fp32/bf16); call ``.backward()`` on it."""
        self._scaled_backward = True
        if not self.scaler.enabled:
            return loss
        return loss.float() * self.scaler.scale

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``scale_loss(loss).backward()``: the portable way to run backward in every precision."""
        self.scale_loss(loss).backward(**kwargs)

    # ------------------------------------------------------------------- grads
    def _prepare_gradients(self) -> None:
        """Final gradient shards, the fp16 overflow verdict, and the unscale factor.

        Works on the device-side shards only (cheap, also when the optimizer is
        offloaded); the factor (1/loss scale, times the clip coefficient once
        clipping ran) is applied where the fp32 gradients are materialized.
        """
        if self._prepared:
            return
        if self.scaler.enabled and not self._scaled_backward:
            raise RuntimeError(
                "zero_strategy: precision='fp16' needs loss scaling: call optimizer.backward(loss) "
                "or optimizer.scale_loss(loss).backward() instead of loss.backward()")
        self.engine.finish_gradients(self.groups)
        # a Python float until clipping makes it a device tensor: the unclipped path never syncs
        self._factor: float | torch.Tensor = 1.0 / self.scaler.scale
        if self.scaler.enabled:
            local_inf = torch.zeros(1, dtype=torch.float32, device=self.engine.device)
            for g in self._shards():
                local_inf = torch.maximum(local_inf, (~torch.isfinite(g)).any().float().reshape(1))
            self.engine.comm.all_reduce(local_inf, op="max", label="fp16 overflow check")
            self._found_inf = bool(local_inf.item())
        self._prepared = True

    def _shards(self) -> list[torch.Tensor]:
        return [g.grads.grad_shard for g in self.groups if g.grads.grad_shard is not None]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm over *all* shards on all ranks; returns that global norm.

        Same result as ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on an
        unsharded model. Call after the last backward of the step, before ``step()``.
        """
        self._refuse_after_early_steps("clip_grad_norm_")
        self._prepare_gradients()
        device = self.engine.device
        if self._found_inf:
            self.last_grad_norm = torch.tensor(float("inf"), device=device)
            return self.last_grad_norm
        shards = self._shards() + (self.rank_local.grads() if self.rank_local is not None else [])
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = torch.zeros(1, dtype=torch.float32, device=device)
            for x in shards:
                local = torch.maximum(local, x.abs().max().float().reshape(1))
            self.engine.comm.all_reduce(local, op="max", label="gradient norm (inf)")
            total = local[0] * self._factor
        else:
            local = torch.zeros(1, dtype=torch.float32, device=device)
            for x in shards:
                local += x.float().abs().pow(norm_type).sum()
            self.engine.comm.all_reduce(local, op="sum", label="gradient norm")
            total = local[0].pow(1.0 / norm_type) * self._factor
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._factor = self._factor * coef
        self.last_grad_norm = total
        return total

    def _refuse_after_early_steps(self, what: str) -> None:
        if self.offloaded.steps_in_flight:
            raise RuntimeError(f"{what}: with overlap_step=True the groups already stepped during backward, "
                               "so their gradients cannot be clipped any more; drop overlap_step to clip")

    def model_parameters(self) -> list:
        """The model's ``nn.Parameter`` objects whose master shards this optimizer steps."""
        return [s.param for g in self.groups for s in g.slots]

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to [-clip_value, clip_value] (after unscaling),
        like ``torch.nn.utils.clip_grad_value_`` on the unsharded model (elementwise, so
        exact on shards). Call after the last backward of the step, before ``step()``."""
        if clip_value < 0:
            raise ValueError(f"clip_grad_value_: clip_value must be >= 0, got {clip_value}")
        self._refuse_after_early_steps("clip_grad_value_")
        self._prepare_gradients()
        if self._found_inf:
            return
        bound = float(clip_value) / float(self._factor)  # shards are still scaled by 1/factor
        for g in self.groups:
            if g.grads.grad_shard is not None:
                g.grads.grad_shard.clamp_(-bound, bound)
                g.grads.mark_changed()  # an offloaded copy downloaded before this is stale
        if self.rank_local is not None:  # expert parallelism's experts: elementwise too, so exact per rank
            self.rank_local.clamp_grads(bound)

    # ------------------------------------------------------------ overlap_step
    def group_reduced(self, group) -> None:
        """The engine reduced ``group`` during a synced backward (See [Note: overlap_step])."""
        if group.optimizer_index == self.index:
            self.offloaded.group_reduced(group)

    def on_backward_started(self, synced: bool) -> None:
        """A backward began (``synced``: outside ``no_sync``, a step follows); See [Note: NVMe state
        read during backward]."""
        self.offloaded.on_backward_started(synced)

    def on_last_gathers_issued(self, synced: bool) -> None:
        """Backward's last stage-3 gathers have begun; See [Note: NVMe state read during backward]."""
        self.offloaded.on_last_gathers_issued(synced)

    @property
    def steps_in_flight(self) -> bool:
        """overlap_step: group steps started during the last backward that ``step()`` has not collected."""
        return self.offloaded.steps_in_flight

    @property
    def steps_overlapped(self) -> int:
        """Group steps started during backward so far (overlap_step)."""
        return self.offloaded.steps_overlapped

    def stepped_early(self, group) -> bool:
        """Whether ``group`` already stepped during the last backward (its gradients are final)."""
        return self.offloaded.stepped_early(group)

    # -------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None) -> Any:
        """One optimizer step over the master shards. See [Note: the order inside ``step()``]."""
        if closure is not None:
            raise ValueError("ZeroOptimizer.step does not take a closure: run forward/backward first, "
                             "then call step()")
        if self.engine.ended is not None:
            raise RuntimeError(
                f"zero_strategy: this optimizer's model is no longer set up ({self.engine.ended}); its "
                "sharded optimizer state is gone. To train on, set it up again: model, optimizer = "
                "zero_strategy.setup(model, torch.optim.AdamW(model.parameters(), ...), config)")
        inner = self.optimizer
        for key, hook in list(inner._optimizer_step_pre_hooks.items()):  # See [Note: hooks fire once per step]
            if key != self._guard.id:
                hook(inner, (inner,), {})
        if getattr(inner.step, "_wrapped_by_lr_sched", False):
            inner._opt_called = True  # what the scheduler's wrapper of inner.step records
        self._step_all()
        for hook in list(inner._optimizer_step_post_hooks.values()):
            hook(inner, (inner,), {})

    def _step_all(self) -> None:
        cleared = [g.name for g in self.groups if self.stepped_early(g) and g.grads.cleared_since_backward()]
        if cleared:
            self._commit_early_steps()  # See [Note: a step overlap_step began is not undone]
            raise OverlapStepCommitted(
                f"zero_strategy: optimizer.step() after the gradients of {cleared[:3]} were cleared or zeroed "
                f"following backward (model.zero_grad(), p.grad = None). {_COMMITTED} This step applied the "
                "gradients as backward left them, not the cleared ones, and dropped them. "
                f"{_SKIP_BEFORE_BACKWARD}")
        self._prepare_gradients()
        try:
            if self._found_inf:
                self.skipped_steps += 1
                return None
            clip = self.config.gradient_clipping
            if clip:
                self.clip_grad_norm_(clip)
            if any(g.masters.steps_on_host for g in self.groups):
                self.offloaded.step(float(self._factor))
            else:
                self._device_step()
            if self.rank_local is not None:
                self.rank_local.step(self._factor)
        finally:
            self._end_step()

    def _end_step(self) -> None:
        """What every step ends with, also one that failed or was skipped."""
        self.scaler.update(self._found_inf)
        self._prepared = False
        self._found_inf = False
        self._scaled_backward = False
        self.engine.last_step_comm = self.engine.comm.stats.as_dict()
        self.engine.comm.stats.reset()
        self.engine.comm.on_step()
        self.engine.host_releases.on_step()  # kept for the next step: See [Note: releases where a phase ends]

    def _device_step(self) -> None:
        """The step on the device, in batches bounded by the fp32 gradient copies they make (one
        call when the gradients are fp32 already). See [Note: fp32 gradients only for the groups
        being stepped] in _engine/storage.py."""
        groups = self.groups
        factor = None if isinstance(self._factor, float) and self._factor == 1.0 else self._factor
        for batch in device_step_batches(groups):
            # host memory: the casts reuse one buffer from step to step (See [Note: the step's casts
            # reuse their buffers] in _mechanisms/cast_scratch.py); a GPU's caching allocator does so itself
            on_host = batch[0].master.device.type == "cpu"
            casts = sum(g.master_grad_cast_numel for g in batch) if on_host else 0
            scratch = self.engine.transfers.cast_scratch.take(casts, torch.float32)
            take = carve(scratch)
            for g in batch:
                mg = g.master_grad(take(g.master_grad_cast_numel))
                if mg is not None and factor is not None:
                    mg.mul_(factor)
                self._set_grad(g, mg)
            del mg
            self._step_masters(batch)
            for g in batch:
                if g.owned:
                    self._set_grad(g, None)
                elif g.master.grad is not g.grads.grad_shard:
                    g.master.grad = None  # an fp32 copy of a low-precision shard: free it now
            del take
            self.engine.transfers.cast_scratch.give_back(scratch)
        for h in publish_masters(groups, self.engine.comm):  # coalesced where small
            h.wait()

    def _set_grad(self, g, grad: torch.Tensor | None) -> None:
        """Hand the optimizer group ``g``'s fp32 gradient (None: take it back). Flat layout: the
        master's ``.grad``. Ownership layout: each owned parameter's view gets its whole reduced
        gradient, and one no rank has a gradient for gets none, so the optimizer skips it as DDP's
        (See [Note: optimizers that need whole tensors] in _optim/layouts.py)."""
        if not g.owned:
            g.master.grad = grad
            return
        untouched = frozenset()
        if grad is not None:
            untouched, g.grads.untouched = g.grads.untouched, frozenset()  # used once, as keep_untouched does
        for s, where, view in self._views[id(g)]:
            view.grad = None if grad is None or s.index in untouched else grad[where].view(s.shape)

    def group_states(self, g) -> list[dict]:
        """The optimizer state of flat group ``g`` on this rank: the master's (flat layout), or one
        per parameter this rank owns (ownership layout)."""
        keys = [v for _, _, v in self._views[id(g)]] if g.owned else [g.master]
        return [self.optimizer.state[k] for k in keys if k in self.optimizer.state]

    def swappable_state(self, g) -> dict:
        """Group ``g``'s optimizer state as its master's store tracks it: the master's (flat layout),
        or every owned parameter's keyed ``p{slot}.{key}`` (See [Note: the ownership layout on NVMe]
        in owned_runs.py)."""
        if g.owned:
            return owned_state(self.optimizer.state, self._views[id(g)], shared_tensors(self.optimizer))
        return self.optimizer.state.get(g.master, {})

    def owned_views(self, g) -> list[tuple[Any, slice, torch.nn.Parameter]]:
        """Ownership layout: (slot, where in the shard, the view stepped) per parameter this rank owns."""
        return list(self._views.get(id(g), ()))

    def _step_masters(self, groups, window: tuple[int, int] | None = None) -> None:
        """The user's optimizer steps the masters of ``groups`` that have a ``.grad`` (unhooked:
        See [Note: hooks fire once per step]); ``window``: elements [a, b) of one group's shard
        (a chunk of a streamed group, _optim/chunked_step.py)."""
        with keep_untouched(self.optimizer, groups, window):  # See [Note: no gradient on any rank] in _engine/gradients.py
            self._internal_steps += 1
            try:
                self._unhooked_step(self.optimizer)
            finally:
                self._internal_steps -= 1

    def _refuse_direct_step(self, optimizer, args, kwargs) -> None:
        """The user's own optimizer object stepped directly would step masters without gradients:
        a silent no-op, so it refuses. Not inside the engine's own step: an optimizer class whose
        ``step`` calls ``super().step()`` reaches torch's hooked step of its base class there."""
        if self._internal_steps:
            return
        raise RuntimeError(
            f"this {type(optimizer).__name__} was re-homed onto ZeRO master shards by zero_strategy.setup; "
            "call step() and zero_grad() on the optimizer setup returned (model, optimizer = "
            "zero_strategy.setup(model, optimizer, config)), not on the original object")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (sharded and accumulated). Always frees them (set_to_none).

        With overlap_step, after a synced backward and before ``step()``: completes the
        step that backward began, drops the gradients, and raises :class:`OverlapStepCommitted`
        (See [Note: a step overlap_step began is not undone])."""
        if self.offloaded.steps_in_flight:
            self._commit_early_steps()
            raise OverlapStepCommitted(
                f"zero_strategy: optimizer.zero_grad() after a backward outside no_sync() without "
                f"optimizer.step() (skipping the batch?). {_COMMITTED} That update is now complete on every "
                f"rank (as after step(); step hooks and LR schedulers did not see it) and the gradients are "
                f"dropped: the batch was not skipped. {_SKIP_BEFORE_BACKWARD}")
        self._drop_gradients()

    def _commit_early_steps(self) -> None:
        """Complete the group steps overlap_step began (upload and all-gather them on every rank,
        in group order), then drop every gradient. See [Note: a step overlap_step began is not undone]."""
        self.engine._recover_if_abandoned(outside_forward=True)  # a backward that raised partway
        try:
            self.offloaded.step(1.0, early_only=True)  # overlap_step has no loss scale nor clipping
        finally:
            self._end_step()
            self._drop_gradients()

    def _drop_gradients(self) -> None:
        self.offloaded.collect_early()  # never drop gradients a worker is still stepping on
        self.engine.zero_grad(self.groups)  # what it frees, the next backward takes again: nothing released
        if self.rank_local is not None:
            self.rank_local.zero_grad()
        self._prepared = False
        self._found_inf = False

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "ZeroOptimizer cannot add param groups after setup(); create the optimizer with all of "
            "its param groups before calling zero_strategy.setup")

    # -------------------------------------------------------------- state dict
    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (resharding checkpoints: zero_strategy checkpoint API).

        With expert parallelism, also this rank's experts' state (``"expert_parallel"``: the state dict of
        the second optimizer that steps them, See [Note: expert parallelism] in _model/expert_parallel.py),
        so it is still the whole of what this rank steps."""
        inner = self.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for pg in self.optimizer.param_groups for p in pg["params"])}
        for g in self.groups:  # state swapped out to NVMe is evicted here: copy it while resident
            keys = [v for _, _, v in self._views[id(g)]] if g.owned else [g.master]
            keys = [k for k in keys if k in self.optimizer.state]
            if g.swap is not None and keys:
                with g.resident(write_back=False):
                    for key in keys:
                        inner["state"][index[id(key)]] = {
                            k: v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in self.optimizer.state[key].items()}
        out = {
            "format": "zero_strategy.local_shard",
            "rank": self.engine.comm.rank,
            "world_size": self.engine.comm.world_size,
            "optimizer": inner,
            "loss_scaler": self.scaler.state_dict(),
        }
        if self.rank_local is not None:
            out["expert_parallel_size"] = self._expert_parallel_size()
            out["expert_parallel"] = self.rank_local.inner.state_dict()
        return out

    def _expert_parallel_size(self) -> int | None:
        ep = self.engine.expert_parallel
        return None if ep is None or self.rank_local is None else ep.size

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("format") != "zero_strategy.local_shard":
            raise ValueError("ZeroOptimizer.load_state_dict expects a dict from ZeroOptimizer.state_dict()")
        if (state_dict["rank"], state_dict["world_size"]) != (self.engine.comm.rank, self.engine.comm.world_size):
            raise ValueError(
                f"this optimizer shard was saved by rank {state_dict['rank']} of {state_dict['world_size']}, "
                f"but this is rank {self.engine.comm.rank} of {self.engine.comm.world_size}; use the "
                "zero_strategy checkpoint API to resume on another world size")
        saved_ep, ep = state_dict.get("expert_parallel_size"), self._expert_parallel_size()
        if saved_ep != ep:
            raise ValueError(
                f"this optimizer shard was saved with expert_parallel_size={saved_ep}, but this optimizer steps "
                f"experts with expert_parallel_size={ep}: each rank's experts differ; use the zero_strategy "
                "checkpoint API (save_checkpoint/load_checkpoint) to resume at another expert_parallel_size")
        if self.engine.offloaded is not None:
            refuse_while_offloaded(self.engine.offloaded, "optimizer.load_state_dict()", ("optim_states", "hp_params"))
        if self.rank_local is not None:
            self.rank_local.inner.load_state_dict(state_dict["expert_parallel"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        for g in self.groups:  # the loaded state tensors rest where the master does (NVMe: swap file)
            g.masters.track_optimizer_state(self.swappable_state(g), replace=True)
        self.scaler.load_state_dict(state_dict["loss_scaler"])


class OverlapStepCommitted(RuntimeError):
    """``overlap_step=True``: the gradients of a synced backward were dropped or cleared before
    ``step()``, but the step that backward began was already applied; it was completed, not
    undone. See [Note: a step overlap_step began is not undone]."""


_COMMITTED = ("With ZeroConfig(overlap_step=True) every backward outside no_sync() must be followed by "
              "optimizer.step(): its groups stepped on the CPU during that backward, and an optimizer step "
              "cannot be undone.")
_SKIP_BEFORE_BACKWARD = ("To skip a batch, decide before its backward (skip the backward), or run a backward "
                         "you may drop inside zero_strategy.no_sync(model); or drop overlap_step.")


def _unhooked_step_of(optimizer: torch.optim.Optimizer):
    """``optimizer``'s step function without torch's hook wrapper. See [Note: hooks fire once per step]."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):  # installed by Optimizer._patch_step_function
        step = step.__wrapped__
    return step


# ------------------------------------------------------------ the fp16 loss scale
class LossScaler:
    """Dynamic (or static) fp16 loss scale with DeepSpeed-style hysteresis."""

    def __init__(self, cfg, enabled: bool):
        self.enabled = enabled
        self.cfg = cfg
        self.scale = float(cfg.initial_scale) if enabled else 1.0
        self._good_steps = 0
        self._hysteresis_left = cfg.hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.enabled or self.cfg.static:
            return
        if found_inf:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)
                self._hysteresis_left = self.cfg.hysteresis
            return
        self._good_steps += 1
        if self._good_steps >= self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self._good_steps = 0
            self._hysteresis_left = self.cfg.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self._good_steps = int(sd["good_steps"])
        self._hysteresis_left = int(sd["hysteresis_left"])
