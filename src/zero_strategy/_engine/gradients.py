"""The flat groups' gradients: where they live until the step, what ``param.grad`` shows, which ranks have one.

One concept, three objects, in the order a gradient meets them: :class:`GradBuffer` (one flat
group's gradients: accumulate, reduce-scatter, the reduced shard), :class:`GradMarkers` (the
``param.grad`` markers the buffer places and what the user did to them), and the step agreement
(:class:`StepAgreements`: which parameters any rank has a gradient for, and
:func:`keep_untouched` for those none has). The reduce order across groups is
_engine/reduce.py's.

**The gradient buffer.**

[Note: gradient buffer states]
``EMPTY``         nothing held (after ``reset()``, the one way back here).
``ACCUMULATING``  ``full_grad`` [padded, reduce dtype] holds this rank's unreduced
                  gradients: some slots written by this or earlier backwards (``no_sync``).
``REDUCING``      a reduce-scatter of ``full_grad`` is in flight.
``REDUCED``       ``grad_shard`` [shard] holds the averaged gradients of this rank's slice.

A reduced buffer may accumulate again (a second backward before the step without
zero_grad, as torch allows): it goes back to ``ACCUMULATING`` keeping ``grad_shard``,
and the next reduce adds onto it. Stage 1 reduces *in place* (``grad_shard`` is the
own slice of its persistent ``full_grad``); accumulating onto that moves the reduced
slice aside (the carry), added back at the next reduce.

The ``param.grad`` markers this buffer places are below ([Note: param.grad after backward]).

**``param.grad`` after backward**: a marker per parameter, and what the user did to it since.

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
it is still intact, which backward placed it); the gradient buffer (above) asks
it what the user cleared and decides what that means for the held gradients.

**Parameters no rank has a gradient for**, inside a flat group that is stepped.

[Note: no gradient on any rank]
DDP with ``find_unused_parameters=True`` leaves ``.grad`` None on a parameter that no
rank used in the step, and torch's optimizers skip such a parameter: it keeps its
value and its state (no weight decay, no momentum). A parameter some ranks used gets
the mean with zeros from the others. The engine computes the same, in three parts:

1. The step agreement (:class:`GradientAgreement` over ``Collectives.begin_agreement``,
   one small all-reduce per optimizer step that also compares the collective
   checksums) tells every rank, per parameter, whether any rank has a gradient for it
   since the last ``zero_grad``. A parameter some rank has one for gets a
   ``param.grad`` marker on every rank, as DDP gives it the mean of the others'.
2. A flat group no rank has a gradient for is not stepped: its master gets no
   ``.grad`` and the user's optimizer skips it, exactly as DDP's parameters. A group
   some rank has one for is reduced on every rank, zeros where a rank has none, so
   the collectives stay in lock-step. Experts and other members of module lists get
   groups of their own for this (See [Note: members get their own flat groups] in
   _engine/units.py), which makes an unused expert exact, Adam's step count included.
3. Inside a group that is stepped, the parameters no rank has a gradient for
   (*untouched*: a projector on a text-only step, an unused head) keep their master
   values and their elementwise optimizer state (:func:`keep_untouched`): the group's
   zero gradient would otherwise move them through weight decay and momentum. What a
   flat group cannot keep apart is state shared by the whole group (Adam's ``step``
   count, which sets the bias correction): it counts the group's steps, where DDP's
   parameter counts its own. Put such a module in a list or dict of one class, or
   in its own unit, to make it exact.

[Note: the agreement at the end of backward]
At stages 2-3 the agreement runs at the end of every synced backward, where DDP
all-reduces its map of the parameters each rank used: it starts once the last
reduce-scatters are issued, so its latency hides behind theirs, and the step that
follows needs no collective of its own (``GradBuffer.agreed``; a new backward, a
``zero_grad`` or the step itself ends it). What it decides is what DDP decides there:
after backward a parameter another rank used has a ``.grad`` here too, and
``model.zero_grad()`` reaches the reduced gradient this rank holds for it (it did not
before: an expert only the other rank's samples reached kept its gradient, and the
next step added onto it). Stage 1 reduces in the step, and agrees there. Gradients
cleared between backward and step are then cleared on this rank without asking the
others, as every rank runs the same code: the step skips a group cleared whole, as
torch skips parameters without ``.grad``. Clearing it on some ranks only is folded into
the collective checksums (``Collectives.note_local``), so the next agreement raises
:class:`CollectiveDesync` instead of letting the ranks step different parameters.

With ``ZeroConfig(overlap_step=True)`` a group is stepped as soon as its gradients are
reduced, before the agreement; a parameter of it no rank used is then stepped with a
zero gradient (documented in docs/how-it-works.md, "Ranks that use different parameters").
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from typing import Iterable, Iterator

import torch

from .._comm.collectives import Collectives, Handle
from .._mechanisms.memory import storage_use_count


class GradState(enum.Enum):
    EMPTY = "empty"
    ACCUMULATING = "accumulating"
    REDUCING = "reducing"
    REDUCED = "reduced"


#: state -> the states it may be entered from (see [Note: gradient buffer states])
_ENTERED_FROM = {
    GradState.ACCUMULATING: {GradState.EMPTY, GradState.ACCUMULATING, GradState.REDUCED},
    GradState.REDUCING: {GradState.EMPTY, GradState.ACCUMULATING, GradState.REDUCED},  # EMPTY: zeros from here
    GradState.REDUCED: {GradState.REDUCING},
    GradState.EMPTY: set(GradState),  # reset() is the one way back, from anywhere
}


class GradBuffer:
    """Gradients of one flat group: accumulate per slot, reduce-scatter, hold the reduced shard."""

    def __init__(self, layout, grad_dtype: torch.dtype, device: torch.device):
        self.layout = layout  # the FlatGroup: slots, padded/shard sizes, own()
        self.grad_dtype, self.device = grad_dtype, device
        self.state = GradState.EMPTY
        self._working_set = layout.transfers.working_set  # See [Note: the working set]
        self._pool = layout.transfers.host_pool  # See [Note: the training cycle's host buffers]
        self._full_grad: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None   # [shard] reduced and averaged
        #: bumped whenever grad_shard's values change (offload re-downloads a stale copy)
        self.version = 0
        n = len(layout.slots)
        #: slots of full_grad written since it was last consumed; the rest is zeroed at reduce
        #: time only (saves a full memset per backward)
        self._written = [False] * n
        self._reduced_in_place = False
        self._carry: torch.Tensor | None = None  # stage 1: reduced slice to add back
        #: per slot, a gradient arrived since the last reset (kept across steps without zero_grad, as
        #: torch keeps .grad): the step agrees over ranks which any has. See [Note: no gradient on any rank]
        self.received_slots = [False] * n
        #: slots no rank has a gradient for in a group that is stepped (set by the step agreement)
        self.untouched: frozenset[int] = frozenset()
        #: the step agreement at the end of the last backward covers this group: the step needs none
        self.agreed = False
        # per-backward bookkeeping (reset by end_backward)
        self.arrived = 0
        self.reduced_this_backward = False
        self.markers = GradMarkers(n)  # See [Note: param.grad after backward]

    # --------------------------------------------------------------- markers
    def _forget(self, slots, keep_full: bool, keep_others: bool, to_none=()) -> None:
        """Drop these slots' held gradients; without others to keep, reset the whole buffer
        (freeing it, as ``set_to_none`` frees ``.grad`` on a plain model). ``to_none``: those
        of them whose ``.grad`` was set to None, which have no gradient now (a zeroed one
        still has one)."""
        if not keep_others:
            self.reset(keep_full)
            return
        for s in slots:
            self.markers.marked[s.index] = False
            self.drop_slot(s)
        for s in to_none:
            self.received_slots[s.index] = False

    def apply_clearings(self, keep_full: bool) -> None:
        """Once per backward, before the group takes new gradients or is reduced: apply the
        clearings made since the last one. A cleared or zeroed parameter starts from nothing
        (torch adds onto zeros), and a group nobody kept is reset. A group this rank's backward
        does not reach is still reduced (zeros from here), onto what it holds: applied then
        too, or a ``model.zero_grad()`` would not reach it. ``keep_full``: stage 1 keeps its
        full buffer's memory."""
        if self.markers.clearings_applied:
            return
        self.markers.clearings_applied = True
        intact, zeroed, dropped = self.markers.sort(self.layout.slots)
        if zeroed or dropped:
            self._forget(zeroed + dropped, keep_full, keep_others=bool(intact), to_none=dropped)
            for s in zeroed:
                s.param.grad = None

    def before_accumulate(self, slot, keep_full: bool) -> None:
        """Autograd is about to accumulate into ``param.grad``: take the marker away, after
        applying the clearings made since the last backward (:meth:`apply_clearings`)."""
        self.apply_clearings(keep_full)
        self.markers.take_away(slot)  # the held gradient stays and this one adds to it

    def mark_received(self, slots, in_backward: bool) -> None:
        """The step agreement says some rank has a gradient for each of ``slots``: this rank holds
        its share of it (in the reduced shard, or reduced at the step), so the parameter has a
        gradient here too, and a ``param.grad`` marker, as DDP's parameter gets the mean of the
        other ranks' gradients. ``in_backward``: the agreement ran at the end of the backward
        that brought them (else in the step after it)."""
        placed_in = self.markers.backwards if in_backward else self.markers.backwards - 1
        for s in slots:
            if not self.received_slots[s.index]:
                self.received_slots[s.index] = True
                if not self.markers.marked[s.index]:
                    self.markers.place(s, placed_in)

    def take_cleared_slots(self, keep_full: bool) -> bool:
        """Before a step: apply clearings made since the last backward (``model.zero_grad()`` after
        backward, or of a parameter the last backward did not reach).

        As torch would: a parameter zeroed in place steps with a zero gradient; one set to None
        has none. A group with no gradient left is skipped, but a flat master cannot skip part
        of itself, so setting part of a group to None after the last backward, while other
        parameters keep theirs, raises instead of stepping those with a zero gradient. Returns
        True when the user cleared the whole group after the last backward: torch would skip
        it, so no rank reduces or steps it.
        """
        intact, zeroed, dropped = self.markers.sort(self.layout.slots)
        replaced = [s.fqn for s in dropped if s.param.grad is not None]
        if replaced:
            raise RuntimeError(
                f"zero_strategy: param.grad of {replaced[:3]} was replaced by a tensor after backward; on a "
                "ZeRO model the gradient lives in the shard, so a step cannot use the new tensor. Scale the "
                "loss instead, clip with optimizer.clip_grad_norm_()/clip_grad_value_(), or assign "
                "param.grad before backward (autograd then accumulates onto it)")
        for s in zeroed:  # a zero gradient is still a gradient: held as zeros from now on
            self.drop_slot(s)
            self.markers.accept_zeroing(s)
        if not dropped:
            return False
        latest = [s.fqn for s in dropped if self.markers.placed_in[s.index] == self.markers.backwards - 1]
        kept = bool(intact or zeroed)
        if kept and latest:
            raise RuntimeError(
                f"zero_strategy: the gradients of {latest[:3]} were cleared after backward (e.g. "
                "submodule.zero_grad()) while other parameters of the same flat group "
                f"{self.layout.name} kept theirs; a sharded step cannot skip part of a group. Clear "
                "gradients before backward or for the whole model (model.zero_grad(), optimizer.zero_grad())")
        self._forget(dropped, keep_full, keep_others=kept, to_none=dropped)
        return not kept and len(latest) == len(dropped)

    def cleared_since_backward(self) -> bool:
        """Whether the user cleared or zeroed a gradient of this group since the last backward
        placed it (``model.zero_grad()``, ``p.grad = None``): what :meth:`take_cleared_slots` applies."""
        _, zeroed, dropped = self.markers.sort(self.layout.slots)
        return bool(zeroed or dropped)

    @property
    def full_grad(self) -> torch.Tensor | None:
        """[padded] this rank's unreduced gradients (a gradient bucket of the working set)."""
        return self._full_grad

    @full_grad.setter
    def full_grad(self, value: torch.Tensor | None) -> None:
        old = self._full_grad
        self._full_grad = value
        self._working_set.replace("grad_buckets", 0 if old is None else old.numel() * old.element_size(),
                                  0 if value is None else value.numel() * value.element_size())
        if old is not None and old is not value:
            self._pool.give_back(old)

    # ------------------------------------------------------------ accumulate
    def accumulate(self, slot) -> None:
        """Move ``param.grad`` into ``full_grad`` (copy or add) and leave the marker, freeing memory early."""
        grad = slot.param.grad
        if grad is None:
            return
        if self._reduced_in_place:
            self._set_reduced_aside()
        if self.full_grad is None:
            self.full_grad = self._pool.empty(self.layout.padded_numel, self.grad_dtype, self.device)
        view = self.full_grad[slot.offset:slot.offset + slot.numel]
        if self._written[slot.index]:
            view.add_(grad.reshape(-1))
        else:
            view.copy_(grad.reshape(-1))
            self._written[slot.index] = True
        self.markers.place(slot)
        self.arrived += 1
        self.received_slots[slot.index] = True
        self._enter(GradState.ACCUMULATING)

    def _set_reduced_aside(self) -> None:
        """Stage 1, before its full buffer takes new sums: gradients accumulate onto reduced ones (no
        zero_grad since the last reduce, e.g. another optimizer stepped), so keep this rank's reduced
        slice aside and start a fresh local sum; the next reduce adds it back, as torch would accumulate."""
        self._carry = self.grad_shard.clone()
        self.grad_shard = None
        self._reduced_in_place = False
        self._written = [False] * len(self._written)

    @property
    def complete(self) -> bool:
        """Every slot's gradient arrived in this backward: the group can be reduced now."""
        return self.arrived >= len(self._written)

    @property
    def has_unreduced(self) -> bool:
        return self.state is GradState.ACCUMULATING

    def drop_slot(self, slot) -> None:
        """Forget one parameter's held gradient (unreduced and reduced parts)."""
        self._written[slot.index] = False
        ranges = [where for s, _, _, where in self.layout.slot_ranges_in_shard() if s is slot]
        for t in (self.grad_shard, self._carry):
            if t is not None:
                for where in ranges:
                    t[where].zero_()
        if ranges and self.grad_shard is not None:
            self.mark_changed()

    def mark_changed(self) -> None:
        """``grad_shard`` was changed in place (e.g. clipped by value): copies of it are stale."""
        self.version += 1

    # ---------------------------------------------------------------- reduce
    def begin_reduce(self, comm: Collectives, in_place: bool) -> tuple[Handle, torch.Tensor]:
        """Start summing ``full_grad`` over ranks into this rank's slice; ``finish_reduce`` averages.

        ``in_place``: the slice is reduced into ``full_grad`` itself (stage 1, whose full
        buffer persists anyway), so stepping needs no extra gradient memory.
        """
        full = self.prepare_reduce(comm)
        out = self.layout.own(full) if in_place else self._pool.empty(self.layout.shard_numel, self.grad_dtype,
                                                                      self.device)
        handle = comm.reduce_scatter(out, full, async_op=True, label=self.layout.name)
        self.now_reducing()
        return handle, out

    def prepare_reduce(self, comm: Collectives) -> torch.Tensor:
        """``full_grad`` [padded] ready to be reduce-scattered: zeros where no gradient arrived
        (a rank that did not use a parameter contributes zeros), pre-divided in fp16. The
        caller issues the collective and then calls :meth:`now_reducing`."""
        layout = self.layout
        if self._reduced_in_place:  # reduced again (another rank has new gradients): keep ours
            self._set_reduced_aside()
        if self.full_grad is None:  # unused on this backward: contribute zeros, stay in lock-step
            self.full_grad = self._pool.zeros(layout.padded_numel, self.grad_dtype, self.device)
        else:
            for s in layout.slots:
                if not self._written[s.index]:
                    self.full_grad[s.offset:s.offset + s.numel].zero_()
            for lo, hi in layout.padding():  # See [Note: the ownership layout] in flat.py
                self.full_grad[lo:hi].zero_()
        full = self.full_grad
        if comm.data_parallel_size > 1 and full.dtype == torch.float16:
            full.div_(comm.data_parallel_size)  # fp16: divide before summing so the sum cannot overflow
        return full

    def now_reducing(self, drop_full: bool = False) -> None:
        """The reduce-scatter of what :meth:`prepare_reduce` returned is issued. ``drop_full``: it
        read ``full_grad`` already (a coalesced one copies it in), so its memory goes now."""
        if drop_full:
            self.full_grad = None
        self.reduced_this_backward = True
        self._enter(GradState.REDUCING)

    def finish_reduce(self, out: torch.Tensor, comm: Collectives, in_place: bool) -> None:
        """Average the reduced slice into ``grad_shard``; free ``full_grad`` unless it persists."""
        comm.all_reduce_replicas(out, label=self.layout.name)  # hybrid: See [Note: hybrid sharding]
        if comm.data_parallel_size > 1 and out.dtype != torch.float16:
            out.div_(comm.data_parallel_size)  # on the shard: 1/N of the work of dividing the full buffer
        self._written = [False] * len(self._written)
        if in_place:
            if self._carry is not None:
                out.add_(self._carry)
                self._carry = None
            self.grad_shard = out
            self._reduced_in_place = True
        else:
            if self.grad_shard is None:
                self.grad_shard = out
            else:
                self.grad_shard.add_(out)
                self._pool.give_back(out)
            self.full_grad = None
        self.version += 1
        self._enter(GradState.REDUCED)

    def start_another_round(self) -> None:
        """Gradients arrive again after this backward reduced the group (reentrant checkpointing
        of a unit called twice; see [Note: reentrant checkpointing and units called twice] in
        _engine/engine.py): count arrivals afresh and reduce again, adding onto ``grad_shard``. The
        caller has finished the first round's reduce-scatter."""
        assert self.state is not GradState.REDUCING, self.state
        self.arrived = 0
        self.reduced_this_backward = False

    # ------------------------------------------------------------------ reset
    def clear_arrivals(self) -> None:
        """The next backward counts arriving gradients (and may reduce) afresh."""
        self.arrived = 0
        self.reduced_this_backward = False
        self.markers.clearings_applied = False

    def end_backward(self) -> None:
        """A backward ended (or was abandoned)."""
        self.clear_arrivals()
        self.markers.backwards += 1

    def reset(self, keep_full: bool) -> None:
        """Drop every held gradient and marker. ``keep_full`` keeps the (stage 1) full buffer's memory."""
        self.markers.remove_all(self.layout.slots)
        shard, self.grad_shard = self.grad_shard, None
        if not self._reduced_in_place:  # in place, it is a view of the full buffer
            self._pool.give_back(shard)
        del shard
        self._carry = None
        self._reduced_in_place = False
        self._written = [False] * len(self._written)
        if not keep_full or (self.full_grad is not None and storage_use_count(self.full_grad) != 1):
            self.full_grad = None  # kept only while no one else holds a view of it (a gradient an optimizer kept)
        self.version += 1
        self.received_slots = [False] * len(self.received_slots)
        self.untouched = frozenset()
        self.agreed = False
        self._enter(GradState.EMPTY)
        self.clear_arrivals()

    @property
    def carried(self) -> torch.Tensor | None:
        """Stage 1: the reduced slice set aside while new gradients accumulate (see ``_set_reduced_aside``)."""
        return self._carry

    def _enter(self, state: GradState) -> None:
        assert self.state in _ENTERED_FROM[state], (
            f"gradient buffer of {self.layout.name}: {self.state.value} -> {state.value} is not a transition")
        self.state = state

    def held_tensors(self) -> list[tuple[str, bool, torch.Tensor]]:
        return [("grads", False, g) for g in (self.full_grad, self.grad_shard) if g is not None]


# ------------------------------------------------------------ param.grad after backward
def nan_placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-memory tensor of ``shape`` whose every element is NaN (one element, stride 0).

    Stands in for the values of a released stage-3 parameter (see [Note: parameter storage
    and aliasing] in _engine/flat.py): reads give NaN, in-place writes raise. An integer
    dtype has no NaN (a 4-bit base's uint8 codes, see [Note: opaque groups] in _engine/flat.py):
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


# ------------------------------------------------------------ the step agreement
class GradientAgreement:
    """The step agreement over ``groups`` (part 1 of the Note), from start to decision.

    Started where every rank has issued the collectives it covers: at the end of a synced
    backward at stages 2-3 (See [Note: the agreement at the end of backward]), otherwise
    in the step. Carries, per parameter, whether this rank has a gradient for it, and per
    group whether this rank must still reduce it (stage 1: every group once per step;
    stages 2-3: what ``no_sync`` left), plus the collective checksums.
    """

    def __init__(self, comm, groups: list, keep_full: bool, unfrozen: list[str]):
        """``unfrozen``: this rank's parameters frozen at setup that have a gradient now."""
        self.groups, self.keep_full, self.unfrozen = groups, keep_full, unfrozen
        received = [r for g in groups for r in g.grads.received_slots]
        needs = [g.grads.has_unreduced or (keep_full and g.grads.grad_shard is None) for g in groups]
        self._received = len(received)
        self._pending = comm.begin_agreement(torch.tensor(received + needs + [bool(unfrozen)]))

    def decide(self, in_backward: bool) -> tuple[list, bool]:
        """Wait, then act on what the ranks agreed: a group no rank has a gradient for is cleared
        (part 2); the others learn their untouched slots (part 3), and every parameter some rank
        has a gradient for carries a ``param.grad`` marker here too, as DDP gives a parameter
        another rank used a ``.grad`` (so that ``model.zero_grad()`` reaches its reduced
        gradient). Returns the groups every rank must reduce now, in order, and whether some
        rank has gradients for parameters frozen at setup (the caller refuses the step).
        ``in_backward``: decided at the end of the backward that brought the gradients."""
        agreed = self._pending.result().tolist()
        to_reduce, at = [], 0
        for g, any_needs in zip(self.groups, agreed[self._received:-1]):
            anyone, at = agreed[at:at + len(g.slots)], at + len(g.slots)
            if not any(anyone):  # not stepped, as DDP's parameters without a gradient
                g.zero_grad(keep_full=self.keep_full)
                continue
            g.grads.untouched = frozenset(s.index for s, a in zip(g.slots, anyone) if not a)
            g.grads.mark_received([s for s, a in zip(g.slots, anyone) if a], in_backward)
            if any_needs:
                to_reduce.append(g)
        return to_reduce, bool(agreed[-1])


class StepAgreements:
    """Where the step agreement runs for one engine, and what the step takes from it: at the end
    of a synced backward at stages 2-3, else in the step (See [Note: the agreement at the end of
    backward])."""

    def __init__(self, comm, keep_full: bool):
        self.comm, self.keep_full = comm, keep_full
        self._unfrozen = False  # what the last backward's agreement said of unfrozen parameters

    def begin(self, groups: list, unfrozen_names) -> GradientAgreement:
        """End of a synced backward, once its last reduce-scatters are issued: start, do not wait.
        ``unfrozen_names()``: this rank's parameters frozen at setup that have a gradient now."""
        return GradientAgreement(self.comm, groups, self.keep_full, unfrozen_names())

    def decide_in_backward(self, agreement: GradientAgreement) -> None:
        """End of backward, its reduce-scatters waited: the step that follows needs no agreement."""
        _, self._unfrozen = agreement.decide(in_backward=True)
        for g in agreement.groups:
            g.grads.agreed = True

    def for_step(self, groups: list, unfrozen_names) -> list:
        """The step of ``groups``: apply the user's clearings since the last backward, agree unless
        that backward did, refuse unfrozen parameters; returns the groups to reduce now."""
        agreed = all(g.grads.agreed for g in groups)  # by the last backward: the same on every rank
        for g in groups:  # model.zero_grad() & co. since then: See [Note: param.grad after backward]
            if g.grads.take_cleared_slots(keep_full=self.keep_full) and agreed:
                self.comm.note_local("gradients cleared after backward", g.name)
        if agreed:
            to_reduce, unfrozen = [], self._unfrozen
        else:
            to_reduce, unfrozen = GradientAgreement(self.comm, groups, self.keep_full,
                                                    unfrozen_names()).decide(in_backward=False)
        if unfrozen:  # requires_grad_(True) after setup: See [Note: conversions on a set-up model]
            raise unfrozen_error(unfrozen_names())
        for g in groups:
            g.grads.agreed = False  # used by this step
        return to_reduce


#: state torch's elementwise optimizers start from something other than zeros: key -> the
#: param-group setting it starts from (Adagrad's accumulator, Rprop's step sizes)
_INITIAL_FROM_GROUP = {"sum": "initial_accumulator_value", "step_size": "lr"}


@contextlib.contextmanager
def keep_untouched(optimizer: torch.optim.Optimizer, groups: Iterable, window: tuple[int, int] | None = None
                   ) -> Iterator[None]:
    """Around one optimizer step of ``groups``: afterwards, put back the master elements and
    the optimizer state (of the master's shape) of their untouched parameters.

    State the step creates (the group's first step) is set back to the optimizer's initial
    value on those elements: a zero gradient plus weight decay (SGD, Adam with
    ``weight_decay``) would have written ``wd * p`` into it. A parameter kept behind while
    a step count shared by its group advanced, and then used again, is warned about once
    per group (the one difference from DDP that is left). ``untouched`` is used once:
    the next step's agreement sets it again.

    ``window=(a, b)``: the one group is stepped a chunk at a time (a streamed NVMe group,
    _optim/chunked_step.py) and its master and state are now elements [a, b) of the shard;
    ``untouched`` is used up by the chunk that ends the shard.
    """
    saved, fresh, kept = [], [], []
    with torch.no_grad():
        for g in groups:
            master = g.master
            if master is None or master.grad is None:  # not stepped now
                continue
            untouched = g.grads.untouched
            if window is None or window[1] >= g.shard_numel:
                g.grads.untouched = frozenset()
                _warn_if_back(g, untouched)
            if not untouched:
                continue
            if window is None or window[1] >= g.shard_numel:
                kept.append((g, untouched))
            where = [w for s, _, _, w in g.slot_ranges_in_shard() if s.index in untouched]
            if window is not None:
                where = _within(where, *window)
            if not where:  # none of them in this rank's shard
                continue
            state = optimizer.state.get(master, {})
            if not state:
                fresh.append((master, where))
            tensors = [master.data] + [v for v in state.values() if torch.is_tensor(v) and v.shape == master.shape]
            saved.append([(t, w, t[w].clone()) for t in tensors for w in where])
    yield
    with torch.no_grad():
        for pieces in saved:
            for t, w, old in pieces:
                t[w].copy_(old)
        for master, where in fresh:
            group = next(pg for pg in optimizer.param_groups if any(p is master for p in pg["params"]))
            for key, t in optimizer.state.get(master, {}).items():
                if torch.is_tensor(t) and t.shape == master.shape:
                    for w in where:
                        t[w].fill_(group.get(_INITIAL_FROM_GROUP.get(key, ""), 0.0))
    for g, untouched in kept:  # state of another shape than the master's: shared by the group (Adam's step)
        state = optimizer.state.get(g.master, {})
        if any(not torch.is_tensor(v) or v.shape != g.master.shape for v in state.values()):
            g.kept_behind |= untouched


def stepped_whole(g) -> None:
    """Group ``g`` was stepped, with no untouched parameter, by a step that does not go through
    :func:`keep_untouched` (the windowed Adam step of _optim/adam_windows.py, which steps only such
    groups): what that would have done for it, the warning for parameters used again after being
    kept behind, and ``untouched`` used up."""
    untouched, g.grads.untouched = g.grads.untouched, frozenset()
    _warn_if_back(g, untouched)


def _within(where: list[slice], a: int, b: int) -> list[slice]:
    """The parts of shard ranges ``where`` inside elements [a, b), relative to ``a``."""
    out = []
    for w in where:
        lo, hi = max(w.start, a), min(w.stop, b)
        if lo < hi:
            out.append(slice(lo - a, hi - a))
    return out


def _warn_if_back(g, untouched: frozenset[int]) -> None:
    """Warn once per group when parameters kept behind have a gradient again."""
    back = g.kept_behind - untouched
    if not back or g.warned_kept_behind:
        return
    g.warned_kept_behind = True
    names = [s.fqn for s in g.slots if s.index in back]
    warnings.warn(
        f"zero_strategy: {names[:4]}{' and more' if len(names) > 4 else ''} had no gradient on any rank "
        f"in steps in which the rest of flat group {g.name!r} was stepped; they kept their values and "
        "optimizer state as with DDP, but the step count the group's optimizer state shares (Adam's bias "
        "correction) advanced for them, so their updates from now on differ slightly from DDP's. To make "
        "them exact, give the module flat groups of its own: put it in an nn.ModuleList or nn.ModuleDict "
        "with the other modules of its class, or outside the blocks. See 'Ranks that use different "
        "parameters' in the how-it-works guide (docs/how-it-works.md).", stacklevel=2)


def unfrozen_names(groups: list) -> list[str]:
    """Parameters frozen at setup that have a gradient now (``requires_grad_(True)`` after setup: See
    [Note: conversions on a set-up model] in _model/conversions.py)."""
    return [s.fqn for g in groups if not g.trainable for s in g.slots
            if s.param.requires_grad and s.param.grad is not None]


def unfrozen_error(names: list[str]) -> RuntimeError:
    """Raised on every rank once the step agreement says some rank has such gradients."""
    which = (f"{names[:4]}{' and more' if len(names) > 4 else ''}" if names
             else "parameters of this model (on another rank)")
    return RuntimeError(
        f"zero_strategy: {which} got gradients but were frozen (requires_grad=False, or in no optimizer) "
        "when the model was set up, so the engine holds no gradient shard, fp32 master or optimizer state "
        "for them and the step would leave them untrained. Unfreeze before zero_strategy.setup / "
        "accelerator.prepare / Trainer.fit (gradual unfreezing: give them requires_grad=True and a param "
        "group with lr=0 until their turn), or call zero_strategy.teardown(model) and set the model up again.")
