"""Activation-checkpoint offload: the inputs a checkpointed layer keeps wait on the host.

[Note: activation offload]
With gradient checkpointing each layer keeps only its input until backward recomputes it
(See [Note: activation memory of a Llama-style decoder] in _estimate_activations.py): L
layers x b·s·h elements, on the device, for the whole forward and most of backward. At long
sequences that is what is left (a 7B Llama at 32K tokens: 8 GiB in bf16). Both of torch's
checkpoints hand those inputs to autograd as saved tensors, outside their own hooks: the
reentrant one through ``ctx.save_for_backward``, the non-reentrant one through the
``_NoopSaveInputs`` node it saves them on before it enters its ``_checkpoint_hook``. So a
``torch.autograd.graph.saved_tensors_hooks`` pair put around the ``checkpoint(...)`` call
sees exactly those inputs (the operations inside are the checkpoint's own business) and
may put them elsewhere. :class:`HostActivations` copies each device tensor to a pinned host
buffer on a side stream, which waits for the compute stream (the tensor is complete) and on
which the device memory is recorded (the caching allocator does not reuse it before the
copy has read it), and copies it back on the compute stream when backward asks, after the
side stream's copy. A tensor already in host memory (a CPU run) stays where it is: the
placement is then a no-op, and the counts say what would have moved.

Hugging Face models checkpoint through ``module._gradient_checkpointing_func`` on each
``GradientCheckpointingLayer`` (set by ``gradient_checkpointing_enable()``, whenever the user
calls it); with ``ZeroConfig(activation_offload=True)`` a forward pre-hook on each such layer
wraps that function once with :func:`offloaded` (_model/install.py puts the hooks on and
teardown takes them and the wrappers off). For a model of your own,
``zero_strategy.offloaded_checkpoint`` is ``torch.utils.checkpoint.checkpoint`` with the
same offload.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class OffloadCounts:
    """What the hooks saw: tensors and bytes sent to the host (moved, or already there)."""

    tensors: int = 0
    bytes: int = 0
    moved_bytes: int = 0  # of those, copied off a device


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors packed into pinned host memory, unpacked back onto their device.
    See [Note: activation offload]."""

    def __init__(self, counts: OffloadCounts | None = None):
        self.counts = counts if counts is not None else OffloadCounts()
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        nbytes = tensor.numel() * tensor.element_size()
        self.counts.tensors += 1
        self.counts.bytes += nbytes
        if tensor.device.type != "cuda":
            return tensor  # already in host memory
        self.counts.moved_bytes += nbytes
        side = _side_stream(tensor.device)
        side.wait_stream(torch.cuda.current_stream(tensor.device))
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(side)
        tensor.record_stream(side)  # the allocator waits for the copy before reusing the memory
        return tensor.device, host, copied

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, copied = packed
        torch.cuda.current_stream(device).wait_event(copied)
        return host.to(device, non_blocking=True)


_SIDE_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for the device-to-host copies."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def offloaded(checkpoint_function: Callable, counts: OffloadCounts | None = None) -> Callable:
    """``checkpoint_function`` (torch's ``checkpoint`` or a partial of it) with the inputs it keeps
    offloaded to the host. See [Note: activation offload]."""
    @functools.wraps(checkpoint_function)
    def run(function, *args, **kwargs):
        with HostActivations(counts):
            return checkpoint_function(function, *args, **kwargs)
    run.offloads_to_host = True
    return run


def offloaded_checkpoint(function: Callable, *args, use_reentrant: bool = False, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=..., **kwargs)`` whose saved
    inputs wait in pinned host memory until backward recomputes ``function``. See [Note: activation
    offload]."""
    return offloaded(checkpoint)(function, *args, use_reentrant=use_reentrant, **kwargs)


#: model -> what its checkpointing layers sent to the host (tests and the curious read it)
_COUNTS: "weakref.WeakKeyDictionary[nn.Module, OffloadCounts]" = weakref.WeakKeyDictionary()


def offload_counts(model: nn.Module) -> OffloadCounts | None:
    """What ``ZeroConfig(activation_offload=True)`` has sent to the host for ``model`` so far."""
    return _COUNTS.get(model)


def checkpointing_layers(model: nn.Module) -> list[nn.Module]:
    """The Hugging Face ``GradientCheckpointingLayer`` modules of ``model``: where it checkpoints."""
    return [m for m in model.modules()
            if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)]


def refuse_without_checkpointing_layers(model: nn.Module, activation_offload: bool) -> None:
    if activation_offload and not checkpointing_layers(model):
        raise ValueError(
            f"zero_strategy: activation_offload is set but {type(model).__name__} has no Hugging Face "
            "checkpointing layers (GradientCheckpointingLayer), whose checkpoint inputs it offloads. For a "
            "model of your own, drop activation_offload and checkpoint with zero_strategy.offloaded_checkpoint "
            "(a drop-in for torch.utils.checkpoint.checkpoint).")


def checkpoint_offload_hooks(model: nn.Module) -> list[Callable[[], None]]:
    """Forward pre-hooks that give every Hugging Face checkpointing layer of ``model`` an offloading
    ``_gradient_checkpointing_func``; returns the undo callbacks (the hooks, then the functions)."""
    counts = _COUNTS[model] = OffloadCounts()
    undo: list[Callable[[], None]] = []
    originals: "weakref.WeakKeyDictionary[nn.Module, Callable]" = weakref.WeakKeyDictionary()

    def before_forward(module: nn.Module, args) -> None:
        current = module.__dict__.get("_gradient_checkpointing_func")
        if current is None or getattr(current, "offloads_to_host", False):
            return
        originals[module] = current  # what gradient_checkpointing_enable() put there
        module.__dict__["_gradient_checkpointing_func"] = offloaded(current, counts)

    for module in checkpointing_layers(model):
        undo.append(module.register_forward_pre_hook(before_forward).remove)

    def restore() -> None:
        for module, original in list(originals.items()):
            if getattr(module.__dict__.get("_gradient_checkpointing_func"), "offloads_to_host", False):
                module.__dict__["_gradient_checkpointing_func"] = original
        _COUNTS.pop(model, None)
    undo.append(restore)
    return undo
