"""The engine: hooks in one place, deciding when units gather, release and reduce.

[Note: the life of one training step]
forward   root pre-hook: gather the root unit (stage 3), cast inputs.
          unit pre-hook: wait for / start the unit's gather, prefetch the next units
          of the gather schedule, wrap inputs so their gradient tells us the
          unit's backward is done.  unit post-hook: release (stage 3), register a
          pre-backward hook on the outputs.
backward  pre-backward (first output gradient): gather the unit again, prefetch the
          units the schedule runs next.  post-accumulate-grad hook per parameter: move the gradient
          into the group's flat buffer; when a group has all its gradients, start its
          reduce-scatter (stages 2-3, outside ``no_sync``).  input-gradient function:
          release the unit.  end-of-backward callback: reduce what is left (unused
          parameters contribute zeros), wait for every reduce-scatter, release all.
step      (optimizer) stage 1 reduces here; see ``_optim/optimizer.py``.

[Note: lock-step]
Every collective is issued in the same order on every rank, also when the ranks use
different parameters (mixture-of-experts routing, an image tower some batches skip):
reduce-scatters in the reduce order (See [Note: reduce order] in _engine/reduce.py), stage-3
gathers in the gather schedule (See [Note: gather schedule] in _engine/units.py), the two
on streams of their own (See [Note: two streams of collectives] in _comm/collectives.py),
and everything deferred to the step in a fixed group order. A parameter no rank used
in a step does not move, as in DDP with ``find_unused_parameters=True`` (See [Note: no
gradient on any rank] in _engine/gradients.py).
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from .._comm.collectives import Collectives
from .._config.policies import NVMeOffload
from .._config.state_kinds import KINDS
from .._mechanisms.background_save import BackgroundSave
from .._mechanisms.memory import ReleasePoints
from .._user_warnings import warn_at_user
from .flat import FlatGroup, ParamSlot, ShardState
from .placement import offload_services, single_device, size_swap_pool
from .plan import ShardingPlan, plan_for
from .reduce import MAX_IN_FLIGHT, ReduceQueue
from .units import GatherSchedule, Pass, Unit, build_units, refuse_replaced_units
from .gradients import StepAgreements, unfrozen_names


# ------------------------------------------------------------ the pieces hooks are made of
def compile_boundary(hook):
    """``hook``, run eagerly even when torch.compile traces the module it is on.

    [Note: torch.compile and the hooks]
    The forward hooks gather and release units: collectives, ``param.data = view`` swaps
    between the flat buffer and the placeholder, ``resize_`` of the buffer's storage,
    autograd hooks on the unit's outputs, Python bookkeeping of the step. Traced, none
    of it is faithful: Dynamo lowers ``param.data = t`` to ``Tensor.set_`` on a graph
    input, which AOT autograd treats as an in-place mutation of that input and which
    bumps the parameter's version counter, so the first backward of a stage-3 unit
    (the parameter saved for backward, then swapped by the release) fails with "modified
    by an inplace operation ... is at version 2; expected version 1". So every forward
    hook is excluded from tracing (``torch.compiler.disable``, recursive, as FSDP2 does
    for its own hooks): Dynamo graph-breaks at the hook, runs it eagerly, and the
    compiled region in between starts with the unit gathered; its parameters enter the
    graph as ordinary inputs (views of the gathered flat buffer). The backward hooks
    (gradient hooks, the pre-backward and end-of-backward callbacks) run in the
    autograd engine, outside any compiled graph, as they do in eager mode.
    """
    return torch.compiler.disable(hook, recursive=True, reason="zero_strategy gather/release hook")


def in_backward() -> bool:
    """Inside an autograd backward pass (a hook or a recomputation run by the engine)."""
    return torch._C._current_graph_task_id() != -1


class TrainingState(enum.Enum):
    """Where the model is in an iteration.


    [Note: training state]
    One enum says where the model is in an iteration: ``IDLE`` between iterations,
    ``FORWARD`` inside the root forward, ``PRE_BACKWARD`` once backward has started
    (units regathered, gradients arriving), ``POST_BACKWARD`` while the end-of-backward
    callback reduces and releases. Transitions are asserted (an illegal one names both
    states). An exception can abandon an iteration anywhere: forward hooks are
    ``always_call`` (a raising forward still releases and returns to ``IDLE``), the
    end-of-backward callback never runs for a backward that raised, so a forward, a
    zero_grad or a step that finds the engine out of ``IDLE`` outside backward calls
    ``reset_iter_state()``: in-flight collectives are waited for, units released and the
    per-backward bookkeeping cleared. The abandoned backward's partial gradients stay,
    as torch's stay in ``.grad``, until the retry loop's zero_grad drops them.
    """

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


class UnitBackwardDone(torch.autograd.Function):
    """Identity on a unit's inputs whose backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def drop_grad(param: nn.Parameter) -> None:
    """A frozen parameter's post-accumulate hook: its gradient is not kept."""
    param.grad = None


def gradient_hooks(engine, keep_full: bool):
    """(post-accumulate hook for every trainable parameter, factory of the pre-accumulate hook
    of one slot) for ``engine``, which they hold weakly.

    [Note: weak self in tensor hooks] tensor hooks live in C++, where Python's garbage
    collector cannot see the cycle parameter -> hook -> engine -> parameter; a strong
    reference here would keep every set-up model alive forever.
    """
    engine_ref = weakref.ref(engine)

    def on_grad(param, engine_ref=engine_ref):
        engine = engine_ref()
        if engine is not None:
            engine._on_grad_accumulated(param)

    def before_grad(group, slot, engine_ref=engine_ref):
        def hook(grad):
            if engine_ref() is not None:
                group.grads.before_accumulate(slot, keep_full)  # See [Note: param.grad after backward]
        return hook

    return on_grad, before_grad


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Tensors inside nested tuples/lists/dicts (including Hugging Face ModelOutput)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


def map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


# ------------------------------------------------------ what the hooks consult outside the step
class GenerationGathers:
    """One engine's generation policy and the state of a ``gathered_for_generation`` block (See
    [Note: gathered for generation] in _model/generation.py): the root's pre-forward reads it."""

    def __init__(self) -> None:
        #: every ``generate()`` of the model's transformers modules runs inside the block
        #: (``gather_once_in_generate``; the TRL front end turns it on)
        self.once_in_generate = False
        #: the budget those blocks use (None: measured, See [Note: gathered for generation])
        self.budget_bytes: int | None = None
        self.depth = 0  # nesting: an inner block (PEFT's generate calling the base model's) is a no-op
        self.fallback_logged = False

    @property
    def active(self) -> bool:
        """Inside a block that holds the units gathered (not one that fell back to per-unit)."""
        return self.depth > 0


def refuse_grad_forward() -> None:
    """Called by the root's pre-forward inside a ``gathered_for_generation`` block when gradients are enabled."""
    raise RuntimeError(
        "zero_strategy: a forward with gradients enabled inside gathered_for_generation(model); the block "
        "releases the parameters at its end, before such a forward's backward would run. Run the forward "
        "under torch.no_grad() (generate() does), or leave the block to train")


def refuse_forward_before_step() -> None:
    """Called by the root's pre-forward while overlap_step's group steps of the last backward await ``step()``."""
    raise RuntimeError(
        "zero_strategy: a forward after a backward outside no_sync() without optimizer.step() between them. "
        "With ZeroConfig(overlap_step=True) every such backward must be followed by optimizer.step(): its "
        "groups already stepped on the CPU during that backward (masters and optimizer state hold the new "
        "values; the parameters reach every rank in step()). Nothing was changed by this refusal: call "
        "optimizer.step() to complete that step. To skip a batch, decide before its backward, or run a "
        "backward you may drop inside zero_strategy.no_sync(model); or drop overlap_step")


def refuse_while_offloaded(record, what: str, kinds=KINDS) -> None:
    """Raise if any of ``kinds`` (None: any kind) is offloaded in ``record`` (``engine.offloaded``, an
    ``OffloadedStates`` of _model/offload_states.py, or None: nothing offloaded): ``what`` needs them.
    Takes the record, not the engine, so every caller below the model surface can ask."""
    if record is None:
        return
    blocking = sorted(record.kinds.intersection(KINDS if kinds is None else kinds), key=KINDS.index)
    if blocking:
        raise RuntimeError(
            f"zero_strategy: {what} while {', '.join(blocking)} are offloaded to the host by "
            "zero_strategy.offload_states(model); call zero_strategy.reload_states(model) first (as "
            "DeepSpeed's engine.reload_states() before training again)")


class ZeroEngine:
    """Owns the units of one model and the hooks that drive them."""

    def __init__(self, model: nn.Module, config, comm: Collectives,
                 optimizer_group_of: dict[int, tuple[int, int]], device: torch.device | None = None,
                 param_init_fn=None, owned_optimizers: frozenset[int] = frozenset(),
                 kept_dtypes: dict[int, torch.dtype] | None = None, loaded_later: frozenset[int] = frozenset(),
                 opaque: frozenset[int] = frozenset(), rank_local: frozenset[int] = frozenset()):
        """``optimizer_group_of``: id(param) -> (which optimizer, which of its param groups).
        ``owned_optimizers``: which optimizers step whole parameters (See [Note: the ownership
        layout] in _engine/flat.py). ``kept_dtypes``: id(param) -> the dtype it computes in where
        the model keeps it out of the precision's (See [Note: parameters kept in fp32] in _engine/units.py).
        ``loaded_later``: ids of meta parameters a pending load fills whole (not initialized).
        ``opaque``: ids of parameters whose values are bit patterns, never cast (See
        [Note: opaque groups] in _engine/flat.py). ``rank_local``: ids of parameters the engine leaves
        alone, each rank holding its own (See [Note: expert parallelism] in _model/expert_parallel.py).

        ``device``/``param_init_fn``: where and how meta-device parameters are materialized.
        """
        self.model = model
        self.config = config
        self.plan: ShardingPlan = plan_for(config.stage)
        self.comm = comm
        self.device = single_device(model, device)
        self.compute_dtype = config.compute_dtype
        # what the hooks read of the config, as plain fields set once (the config is frozen)
        self.cast_forward_inputs: bool = config.cast_forward_inputs
        self.overlap_step: bool = config.overlap_step
        self.prefetch: int = config.prefetch
        self.grad_dtype = config.gradient_reduce_dtype
        self._optimizer_group_of = optimizer_group_of
        self.transfers, self.swap = offload_services(model, config, comm, self.device)
        self.units: list[Unit] = build_units(
            model, plan=self.plan, unit_classes=tuple(config.unit_classes),
            persistence_threshold=config.param_persistence_threshold,
            optimizer_group_of=optimizer_group_of, compute_dtype=self.compute_dtype,
            grad_dtype=self.grad_dtype, comm=comm, device=self.device,
            offload_optimizer=config.offload_optimizer, offload_params=config.offload_params,
            transfers=self.transfers, param_init_fn=param_init_fn, swap=self.swap,
            owned_optimizers=owned_optimizers, release_host_memory=config.release_host_memory,
            kept_dtypes=kept_dtypes, loaded_later=loaded_later, opaque=opaque, rank_local=rank_local,
        )
        self.root = self.units[0]
        #: stage 3 with parameter shards on NVMe: backward's gathers read the swap file
        self.backward_reads_swap: bool = self.plan.shards_parameters and isinstance(config.offload_params, NVMeOffload)
        self.groups: list[FlatGroup] = [g for u in self.units for g in u.groups]
        if self.swap is not None:
            size_swap_pool(self.swap, self.units, config.prefetch)
        self.trainable_groups = [g for g in self.groups if g.trainable]
        #: where freed host memory goes back to the OS (See [Note: releases where a phase ends])
        self.host_releases = ReleasePoints(config.release_host_memory, self._drop_idle_buffers)
        #: id(param) -> (its flat group, its slot) for every parameter the engine holds: the one
        #: answer to "is this parameter managed, and where" (its full shape is ``slot.shape``)
        self.managed: dict[int, tuple[FlatGroup, ParamSlot]] = {
            id(s.param): (g, s) for g in self.groups for s in g.slots
        }
        self._unit_of_group = {id(g): u for u in self.units for g in u.groups}
        self._handles: list[Any] = []
        if self.plan.shards_parameters:
            comm.split_gradient_stream()  # See [Note: two streams of collectives]
        self.agreements = StepAgreements(comm, self.plan.keeps_full_gradients)
        self.reduces = ReduceQueue(comm.gradients, [(u.name, [g for g in u.groups if g.trainable]) for u in self.units],
                                   in_place=self.plan.keeps_full_gradients,
                                   in_flight_limit=lambda: 1 if self._overlapping() else MAX_IN_FLIGHT,
                                   on_reduced=self._on_reduced)
        self.schedule = GatherSchedule([u for u in self.units[1:] if u.sharded_groups], config.prefetch)
        self._sync_gradients = True
        # See [Note: training state]: every "where are we in the iteration" fact lives here,
        # and reset_iter_state() puts each back.
        self.training_state = TrainingState.IDLE
        self._backward_task = -1  # graph task the end-of-backward callback is queued on
        self._root_forward_depth = 0
        self.last_step_comm: dict = {}
        self.optimizer_refs: list = []  # weakrefs to the ZeroOptimizers stepping this engine's masters
        #: what setup put on the user's model (_model/install.py), undone by teardown
        self.undo_on_teardown: list = []
        #: the model's sequence-parallel group (_comm/sequence_parallel.py), set by setup; the
        #: step never reads it: See [Note: sequence parallelism] in _model/sequence_parallel.py
        self.sequence_parallel = None
        #: the model's expert-parallel experts (_model/expert_parallel.py), set by setup: parameters
        #: no unit holds, which full_state_dict gathers and the optimizers step (None: none)
        self.expert_parallel = None
        #: generate() policy and the gathered_for_generation block (_model/generation.py)
        self.generation = GenerationGathers()
        #: why the model is no longer set up (teardown, a conversion): its optimizers refuse to step
        self.ended: str | None = None
        #: what zero_strategy.offload_states moved to the host: an OffloadedStates of
        #: _model/offload_states.py (None: nothing offloaded); the hooks only read its kinds
        self.offloaded = None
        #: the asynchronous checkpoint save in flight, if any (checkpoint/_save.py): waited for by the
        #: next save, a load and teardown; its staged buffers count in memory_report
        self.background_save = BackgroundSave()
        self._register_hooks()

    def __repr__(self) -> str:
        sharded = sum(1 for u in self.units if u.sharded_groups)
        return (f"ZeroEngine(stage={self.plan.stage}, world_size={self.comm.world_size}, "
                f"units={len(self.units)} ({sharded} sharded), groups={len(self.groups)}, "
                f"params={sum(g.numel for g in self.groups)}, state={self.training_state.value})")

    @property
    def is_idle(self) -> bool:
        """Between iterations: no forward or backward running or abandoned."""
        return self.training_state is TrainingState.IDLE and self._root_forward_depth == 0

    def optimizers(self) -> list:
        """The live ZeroOptimizers stepping this engine's masters."""
        return [z for z in (ref() for ref in self.optimizer_refs) if z is not None]

    @property
    def steps_overlapped(self) -> int:
        """Group steps started during backward so far (overlap_step), over all optimizers."""
        return sum(z.steps_overlapped for z in self.optimizers())

    # ------------------------------------------------------------ training state
    def _assert_state(self, *allowed: TrainingState) -> None:
        if self.training_state not in allowed:
            raise AssertionError(
                f"zero_strategy: illegal transition from {self.training_state.value} (expected one of "
                f"{[s.value for s in allowed]}); call zero_strategy.reset_iter_state(model) after an "
                "iteration that was interrupted")

    def _recover_if_abandoned(self, outside_forward: bool = False) -> None:
        """An iteration an exception abandoned: reset first. A backward that raised never ran its
        end-of-backward callback; a forward interrupted by a ``BaseException`` that is not an
        ``Exception`` (KeyboardInterrupt) never ran the always_call hooks either, so its depth
        stays up: zero_grad and step (``outside_forward``, never called inside a forward) reset
        it too, while a forward cannot tell it from a nested call of the root."""
        if self.training_state is TrainingState.IDLE or in_backward():
            return
        if self._root_forward_depth == 0 or outside_forward:
            self.reset_iter_state()

    def reset_iter_state(self) -> None:
        """Put the engine back to IDLE after an iteration abandoned by an exception.

        Waits for every collective already issued (all ranks issued the same ones, so
        this keeps them in lock-step), releases every unit, and clears the per-iteration
        bookkeeping. Gradients a raising backward already produced stay, exactly as torch
        keeps them in ``.grad``: they carry markers (See [Note: param.grad after backward]),
        so the retry loop's ``optimizer.zero_grad()`` or ``model.zero_grad()`` drops them.
        """
        was_in_backward = self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
        for unit in self.units:
            unit.wait_gather()
        self.schedule.abandon()
        self.reduces.wait_all(notify=False)
        self.reduces.end_backward()
        for g in self.groups:
            g.grads.end_backward() if was_in_backward else g.grads.clear_arrivals()
        if self.plan.shards_parameters:
            self.release_all()
        self._root_forward_depth = 0
        self._backward_task = -1
        self.training_state = TrainingState.IDLE

    # ------------------------------------------------------------- registration
    def _register_hooks(self) -> None:
        # every forward hook is a torch.compile boundary: See [Note: torch.compile and the hooks]
        self._handles.append(self.model.register_forward_pre_hook(
            compile_boundary(self._root_pre_forward), with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(
            compile_boundary(self._root_post_forward), with_kwargs=True, always_call=True))
        if self.plan.shards_parameters:
            for unit in self.units[1:]:
                if unit.sharded_groups:
                    self._handles.append(unit.module.register_forward_pre_hook(
                        compile_boundary(self._make_unit_pre_forward(unit)), with_kwargs=True))
                    self._handles.append(unit.module.register_forward_hook(
                        compile_boundary(self._make_unit_post_forward(unit)), with_kwargs=True,
                        always_call=True))
            # A submodule holding root-unit parameters may be called directly, not through the
            # root's forward (a GAN's discriminator in manual optimization): gather on demand.
            root_params = {id(s.param) for g in self.root.sharded_groups for s in g.slots}
            for m in self.model.modules():
                if m is not self.model and any(id(p) in root_params for p in m.parameters(recurse=False)):
                    self._handles.append(m.register_forward_pre_hook(self._gather_root_on_demand))
        dropped = []
        on_grad, before_grad = gradient_hooks(self, self.plan.keeps_full_gradients)
        for g in self.groups:
            for s in g.slots:
                if g.trainable:
                    self._handles.append(s.param.register_hook(before_grad(g, s)))
                    self._handles.append(s.param.register_post_accumulate_grad_hook(on_grad))
                elif s.param.requires_grad:
                    dropped.append(s.fqn)
                    self._handles.append(s.param.register_post_accumulate_grad_hook(drop_grad))
        if dropped and self._optimizer_group_of:  # without any optimizer (inference) nothing is surprising
            warn_at_user(
                f"{len(dropped)} parameter(s) require grad but are in no optimizer param group "
                f"(e.g. {dropped[:3]}); they are treated as frozen and their gradients dropped. "
                "Add them to the optimizer or set requires_grad=False.")

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.transfers.close()
        if self.swap is not None:
            self.swap.close()

    # ------------------------------------------------------------------ forward
    def _root_pre_forward(self, module, args, kwargs):
        if self._root_forward_depth == 0 and not in_backward():
            self._recover_if_abandoned()
            self._assert_state(TrainingState.IDLE)
            if self.overlap_step and any(z.steps_in_flight for z in self.optimizers()):
                refuse_forward_before_step()  # See [Note: a step overlap_step began is not undone] in _optim/optimizer.py
            if self.offloaded is not None:
                refuse_while_offloaded(self.offloaded, "forward (or generate)", ("lp_params",))
            if self.generation.active and torch.is_grad_enabled():
                refuse_grad_forward()  # See [Note: gathered for generation] in _model/generation.py
            refuse_replaced_units(self.model, self.units[1:])
            if not torch.is_grad_enabled():
                self.host_releases.on_no_grad_forward()  # eval after training: See [Note: releases where a phase ends]
            self.training_state = TrainingState.FORWARD
            if not self.generation.active:  # held gathered, a forward issues no collective
                self.comm.enter("forward")  # See [Note: naming the rank that failed] in _comm/faults.py
            if self.plan.shards_parameters:
                self.schedule.begin(Pass.FORWARD)
        self._root_forward_depth += 1
        if self.plan.shards_parameters:
            self.root.gather(self.comm)
        if self.cast_forward_inputs and self.compute_dtype != torch.float32:
            cast = lambda t: t.to(self.compute_dtype) if t.is_floating_point() else t  # noqa: E731
            return map_tensors(args, cast), map_tensors(kwargs, cast)
        return None

    def _gather_root_on_demand(self, module, args) -> None:
        """Inside the root's forward (the usual call) the root is gathered already: this test
        is all torch.compile traces (a guard on the depth), so the model's forward is not cut
        into pieces at every root-unit submodule. See [Note: torch.compile and the hooks]."""
        if self._root_forward_depth == 0:
            self._gather_root_now()

    @compile_boundary
    def _gather_root_now(self) -> None:
        if self.root.state is ShardState.SHARDED:
            self.root.gather(self.comm)  # released again at the end of backward or of a no-grad forward

    def _root_post_forward(self, module, args, kwargs, output):
        """Also runs when forward raised (``always_call``; ``output`` is then None)."""
        self._root_forward_depth = max(0, self._root_forward_depth - 1)
        if self._root_forward_depth > 0 or in_backward():  # nested, or recomputed inside backward
            return None
        self.training_state = TrainingState.IDLE
        if self.plan.shards_parameters and output is not None:  # a raising forward leaves no pass to finish
            self.schedule.finish(self.comm)  # See [Note: gather schedule] in _engine/units.py
        outputs = [t for t in tensors_in(output) if t.requires_grad] if torch.is_grad_enabled() else []
        if outputs:  # See [Note: end of backward in the outermost graph task]
            register_multi_grad_hook(outputs, lambda grads: self._ensure_end_of_backward_callback(), mode="any")
        elif self.plan.shards_parameters:
            self.release_all()  # eval / no_grad / generate step: nothing will come back for them
        return None

    def _make_unit_pre_forward(self, unit: Unit):
        def hook(module, args, kwargs):
            # in order, usually already begun by a prefetch; inside backward a recomputation (activation
            # checkpointing), which the reentrant kind runs before the unit's backward gathers it
            self.schedule.use(unit, self.comm)
            unit.wait_gather()
            if not torch.is_grad_enabled():
                return None
            flat = tensors_in((args, kwargs))
            if not any(t.requires_grad for t in flat):
                return None
            return self._wrap_inputs(unit, args, kwargs)
        return hook

    def _wrap_inputs(self, unit: Unit, args, kwargs):
        needing = []
        map_tensors((args, kwargs), lambda t: needing.append(t) if t.requires_grad else None)
        wrapped = UnitBackwardDone.apply(lambda: self._post_backward(unit), *needing)
        it = iter(wrapped)
        replace = lambda t: next(it) if t.requires_grad else t  # noqa: E731
        new_args, new_kwargs = map_tensors((args, kwargs), replace)
        return new_args, new_kwargs

    def _make_unit_post_forward(self, unit: Unit):
        def hook(module, args, kwargs, output):
            if in_backward():
                return None  # recomputation (activation checkpointing): backward still needs it
            outputs = [t for t in tensors_in(output) if t.requires_grad]
            if torch.is_grad_enabled() and outputs:
                register_multi_grad_hook(outputs, lambda grads: self._pre_backward(unit), mode="any")
            unit.release()
            return None
        return hook

    # ----------------------------------------------------------------- backward
    def _ensure_end_of_backward_callback(self) -> None:
        """Queue the end-of-backward callback at the first hook of a backward. ``PRE_BACKWARD``
        means it is queued: the inner backward of reentrant checkpointing shares the outer's.

        [Note: end of backward in the outermost graph task]
        ``queue_callback`` queues on the graph task running *now*. Reentrant checkpointing
        (``checkpoint(..., use_reentrant=True)``, HF ``gradient_checkpointing_enable``'s old
        default) runs each checkpointed block's backward as a nested graph task; a callback
        queued there runs when that block is done, releases every unit and reduces groups
        whose gradients have not arrived yet. So the first hook of a backward must be one
        the outer task runs: the hook the root's post-forward puts on the model's outputs,
        whose gradients are the first thing any backward through the model computes. The
        gradient and pre-backward hooks still queue it for a backward that starts elsewhere
        (a unit's outputs used directly). Without this, a frozen root (LoRA) or a model
        called twice per iteration (so the root's gradients arrive only after a block's
        nested backward) released the root mid-backward: stage 3 read an empty parameter.
        """
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        if self.offloaded is not None:  # overlap_step steps during backward: it needs everything
            refuse_while_offloaded(self.offloaded, "backward", None if self.overlap_step else (
                "lp_params", "lp_grads", "contiguous_grad_buffer"))
        self._assert_state(TrainingState.IDLE, TrainingState.FORWARD)
        self.training_state = TrainingState.PRE_BACKWARD
        if self.plan.shards_parameters:
            self.schedule.begin(Pass.BACKWARD)
        self._backward_task = torch._C._current_graph_task_id()
        for g in self.trainable_groups:  # new gradients: the last agreement no longer covers them
            g.grads.agreed = False
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        for zopt in self.optimizers():  # what to read ahead for the step is theirs to decide:
            zopt.on_backward_started(self._sync_gradients)  # See [Note: NVMe state read during backward]

    def _pre_backward(self, unit: Unit) -> None:
        self._ensure_end_of_backward_callback()
        with torch.profiler.record_function(f"zero::pre_backward::{unit.name}"):
            self.schedule.use(unit, self.comm)
            if self.schedule.remaining() <= self.prefetch:  # the last gathers have begun
                for zopt in self.optimizers():
                    zopt.on_last_gathers_issued(self._sync_gradients)
            unit.wait_gather()

    def _post_backward(self, unit: Unit) -> None:
        """The unit's backward is done. A unit called twice in one forward is gathered
        again by the pre-backward hook of its earlier call, so releasing here is safe."""
        unit.release()

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        self._ensure_end_of_backward_callback()
        group, slot = self.managed[id(param)]
        if self.overlap_step and any(z.stepped_early(group) for z in self.optimizers()):
            if group.grads.reduced_this_backward and self._in_nested_backward():
                raise RuntimeError(
                    f"zero_strategy: overlap_step=True already stepped {group.name} in this backward when "
                    "reentrant checkpointing brought its gradients again (a unit called more than once per "
                    "iteration: one nested backward per call). Use checkpoint(..., use_reentrant=False) "
                    "(HF: gradient_checkpointing_kwargs={'use_reentrant': False}), or drop overlap_step")
            raise RuntimeError(
                "zero_strategy: overlap_step=True already stepped these parameters during the last "
                "backward; call optimizer.step() after every backward outside no_sync() (accumulate "
                "micro-batches inside no_sync), or drop overlap_step")
        if group.grads.reduced_this_backward and self._in_nested_backward():
            # See [Note: reentrant checkpointing and units called twice]
            self.reduces.wait_all()  # the first round's reduce-scatter still reads full_grad
            group.grads.start_another_round()
        if group.grads.reduced_this_backward:
            raise RuntimeError(
                f"zero_strategy: gradient of {slot.fqn} arrived after its group {group.name} was "
                "reduced in this backward; is the parameter used after its unit's backward?")
        group.grads.accumulate(slot)
        if self.plan.reduces_in_backward and self._sync_gradients and group.grads.complete:
            self.reduces.complete(group)  # launched in the reduce order: See [Note: reduce order]

    def _in_nested_backward(self) -> bool:
        """Inside a graph task other than the one the end-of-backward callback waits on: the
        nested backward reentrant checkpointing runs for one checkpointed call.

        [Note: reentrant checkpointing and units called twice]
        Autograd accumulates a parameter's gradient once per graph task, after summing every
        use in it, so one backward brings each gradient once and a group is reduced when all
        have come. Reentrant checkpointing runs a nested graph task per checkpointed call: a
        unit called twice in one iteration (two forwards before one backward, a block
        reused) brings its gradients once per call. The second round is accumulated and
        reduced again onto the shard (``GradBuffer.start_another_round``), as a second
        backward before the step would be: exact, one extra reduce-scatter of the group per
        extra call. DDP refuses this case ("mark a variable ready only once") unless
        ``static_graph=True``; non-reentrant checkpointing needs no extra reduce.
        """
        return torch._C._current_graph_task_id() != self._backward_task

    def _on_reduced(self, group: FlatGroup) -> None:
        """A reduce-scatter finished; with overlap_step (every finished reduce starts a CPU step,
        so the queue keeps one in flight) during backward, the group's step can start."""
        if self._overlapping() and in_backward():
            for zopt in self.optimizers():  # See [Note: overlap_step] in _optim/offloaded_step.py
                zopt.group_reduced(group)

    def _overlapping(self) -> bool:
        return self.overlap_step and self._sync_gradients

    def _end_of_backward(self) -> None:
        self._assert_state(TrainingState.PRE_BACKWARD)
        self.training_state = TrainingState.POST_BACKWARD
        if self.plan.shards_parameters:
            self.schedule.finish(self.comm)  # units this rank's backward skipped: See [Note: gather schedule]
        agreement = None
        if self.plan.reduces_in_backward and self._sync_gradients:
            for g in self.trainable_groups:  # reduced below whether reached or not: clearings first
                g.grads.apply_clearings(keep_full=self.plan.keeps_full_gradients)
            self.reduces.flush()  # what is left, in the reduce order (zeros where unused)
            # See [Note: the agreement at the end of backward]
            agreement = self.agreements.begin(self.trainable_groups, self._unfrozen)
        self.reduces.wait_all()
        if agreement is not None:
            self.agreements.decide_in_backward(agreement)
        self.reduces.end_backward()
        for g in self.groups:
            g.grads.end_backward()
        if self.plan.shards_parameters:
            self.release_all()
        self._backward_task = -1
        self.training_state = TrainingState.IDLE

    # --------------------------------------------------------------- utilities
    def _drop_idle_buffers(self) -> None:
        """Where a phase ends: the buffers kept from one step to the next that no one holds now."""
        self.transfers.cast_scratch.release()
        self.transfers.host_pool.release()  # See [Note: the training cycle's host buffers] in _mechanisms/memory.py
        if self.swap is not None:
            self.swap.pool.drop_idle()  # See [Note: staging between passes] in _mechanisms/memory.py

    def release_all(self) -> None:
        for u in self.units:
            u.release()

    def finish_gradients(self, groups: list[FlatGroup] | None = None) -> None:
        """Make the groups' grad_shards final before clipping or stepping (stage 1 reduces here).

        ``groups``: one optimizer's groups (default: all trainable groups).
        """
        self._recover_if_abandoned(outside_forward=True)
        if self.offloaded is not None:
            refuse_while_offloaded(self.offloaded, "optimizer.step() (or gradient clipping)")
        self.reduces.wait_all()
        groups = self.trainable_groups if groups is None else groups
        for g in self.agreements.for_step(groups, self._unfrozen):
            self.reduces.launch([g])  # every rank reduces it, with zeros where it has no gradient
        self.reduces.wait_all(notify=False)
        for g in self.groups:
            g.grads.clear_arrivals()  # the step-time reduce (stage 1) is not a late gradient next time

    def _unfrozen(self) -> list[str]:
        return unfrozen_names(self.groups)  # See [Note: conversions on a set-up model] in _model/conversions.py

    def zero_grad(self, groups: list[FlatGroup] | None = None) -> None:
        """Drop the gradients of ``groups`` (default: all); also ends an abandoned iteration."""
        self._recover_if_abandoned(outside_forward=True)
        if self.offloaded is not None:
            refuse_while_offloaded(self.offloaded, "zero_grad()", ("lp_grads", "contiguous_grad_buffer"))
        for g in self.groups if groups is None else groups:
            g.zero_grad(keep_full=self.plan.keeps_full_gradients)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no reduce-scatter) inside the context."""
        previous = self._sync_gradients
        self._sync_gradients = False
        try:
            yield
        finally:
            self._sync_gradients = previous

    def unit_of(self, group: FlatGroup) -> Unit:
        return self._unit_of_group[id(group)]

    def full_shape(self, t: torch.Tensor) -> torch.Size:
        """``t``'s whole shape: its slot's where the engine holds it (a stage-3 parameter is empty
        at rest), else its own."""
        entry = self.managed.get(id(t))
        return entry[1].shape if entry is not None else t.shape

    def group_of(self, param: nn.Parameter) -> FlatGroup | None:
        entry = self.managed.get(id(param))
        return entry[0] if entry else None
