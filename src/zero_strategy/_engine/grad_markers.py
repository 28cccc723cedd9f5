"""``param.grad`` after backward: a marker per parameter, and what the user did to it since.

[Note: param.grad after backward]
The engine moves each gradient into the flat buffer as it arrives, so ``param.grad``
holds no values after backward. It holds a *marker* (:class:`GradInShard`): a
zero-memory tensor with the parameter's shape, dtype and device. It makes the user's
own gradient code exact or loud:
* ``model.zero_grad()``, ``submodule.zero_grad()``, ``p.grad = None`` and
  ``zero_grad(set_to_none=False)`` (``zero_()``, also ``p.grad.data.zero_()``, bumps
  the marker's version) are seen when the group's next gradient arrives (the
  per-parameter pre-accumulate hook, ``before_accumulate``) or at the step
  (``take_cleared_slots``): a parameter set to None has no gradient, one zeroed has
  zeros, as in torch;
* a tensor the user assigned to ``p.grad`` before a backward is accumulated onto by
  autograd and then taken into the buffer, as torch would; one assigned between
  backward and step cannot be used, and the step raises;
* anything else on the marker (reading values, ``norm()``, ``clip_grad_norm_``,
  ``masked_fill_``, arithmetic) raises at once with the fix, instead of giving a
  plausible number.

:class:`GradMarkers` is the per-group bookkeeping (which slots carry a marker, whether
it is still intact, which backward placed it); the gradient buffer (grads.py) asks
it what the user cleared and decides what that means for the held gradients.
"""

from __future__ import annotations

import torch


def nan_placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-memory tensor of ``shape`` whose every element is NaN (one element, stride 0).

    Stands in for the values of a released stage-3 parameter (see [Note: parameter storage
    and aliasing] in _engine/flat.py): reads give NaN, in-place writes raise. An integer
    dtype has no NaN (a 4-bit base's uint8 codes, See [Note: opaque groups] in _engine/flat.py):
    its placeholder reads the dtype's largest value.
    """
    t = torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device)
    return t.fill_(float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max)


# What a marker answers: metadata, and the calls zero_grad(set_to_none=False) makes.
_MARKER_PROPERTIES = ("shape", "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "layout", "ndim",
                      "_version", "is_cuda", "is_sparse", "is_meta", "is_quantized", "is_nested", "names")
_MARKER_METADATA = {getattr(torch.Tensor, n).__get__ for n in _MARKER_PROPERTIES if hasattr(torch.Tensor, n)} | {
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.stride,
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.is_contiguous,
    torch.Tensor.requires_grad_, torch.Tensor.detach_}
_MARKER_ZEROING = {torch.Tensor.zero_, torch._foreach_zero_}
_DATA_GET = torch.Tensor.data.__get__


class GradInShard(torch.Tensor):
    """``param.grad`` after backward: the gradient is in the flat group's shard, not here.

    See [Note: param.grad after backward]. Metadata reads and zeroing work; anything that
    would read or change values raises at once with the fix, instead of a plausible number.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _MARKER_METADATA or func in _MARKER_ZEROING:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if func == _DATA_GET:  # p.grad.data.zero_(): the marker itself
            return args[0]
        if func == torch.Tensor.__repr__:
            return f"GradInShard(shape={tuple(args[0].shape)}: the gradient lives in a ZeRO shard)"
        name = getattr(func, "__name__", str(func))
        raise RuntimeError(
            f"zero_strategy: {name} on param.grad after backward: on a ZeRO model the gradient lives in "
            "the flat group's shard and param.grad is only a marker. Clear gradients with zero_grad() "
            "(model or optimizer), clip with optimizer.clip_grad_norm_()/clip_grad_value_(), scale "
            "the loss instead of the gradients")


def _new_marker(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(marker, its plain base): the base shares the marker's version counter, read without
    the subclass's dispatch on the hot path."""
    base = nan_placeholder(param.shape, param.dtype, param.device)
    return torch.Tensor._make_subclass(GradInShard, base, False), base


class GradMarkers:
    """The ``param.grad`` markers of one flat group's slots, and the clearings made to them."""

    def __init__(self, n_slots: int):
        self._markers: list[torch.Tensor | None] = [None] * n_slots
        self._bases: list[torch.Tensor | None] = [None] * n_slots  # same version counter
        self._version = [0] * n_slots  # the base's version when the marker was placed or accepted
        self.marked = [False] * n_slots
        self.placed_in = [0] * n_slots  # which backward placed the marker
        self.backwards = 0  # backwards ended so far
        self.clearings_applied = False  # this backward already applied the user's clearings

    def intact(self, slot) -> bool:
        """The marker is still ``param.grad`` and was not zeroed in place."""
        i = slot.index
        return slot.param.grad is self._markers[i] and self._bases[i]._version == self._version[i]

    def sort(self, slots) -> tuple[list, list, list]:
        """The marked ones of ``slots`` as (intact, zeroed in place, set to None or replaced)."""
        intact, zeroed, dropped = [], [], []
        for s in slots:
            if self.marked[s.index]:
                if self.intact(s):
                    intact.append(s)
                elif s.param.grad is self._markers[s.index]:
                    zeroed.append(s)
                else:
                    dropped.append(s)
        return intact, zeroed, dropped

    def place(self, slot, placed_in: int | None = None) -> None:
        """``param.grad`` becomes this slot's marker (made once, then reused)."""
        i = slot.index
        if self._markers[i] is None:
            self._markers[i], self._bases[i] = _new_marker(slot.param)
        slot.param.grad = self._markers[i]
        self._version[i] = self._bases[i]._version
        self.marked[i] = True
        self.placed_in[i] = self.backwards if placed_in is None else placed_in

    def accept_zeroing(self, slot) -> None:
        """The marker was zeroed in place and that is now accounted for (held as zeros)."""
        self._version[slot.index] = self._bases[slot.index]._version

    def take_away(self, slot) -> None:
        """Autograd accumulates into ``param.grad`` next: it must find None, not the marker."""
        if self.marked[slot.index]:
            self.marked[slot.index] = False
            slot.param.grad = None

    def remove_all(self, slots) -> None:
        """Every marker still in place goes (``param.grad = None``); a user's own tensor stays."""
        for s in slots:
            if self.marked[s.index] and s.param.grad is self._markers[s.index]:
                s.param.grad = None
        self.marked = [False] * len(self.marked)
