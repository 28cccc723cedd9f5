"""The small pieces the engine's hooks are made of: the training-state enum, the boundary
torch.compile does not trace, and the autograd function that tells a unit's backward is done.

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

from __future__ import annotations

import enum
import weakref

import torch
from torch import nn


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
