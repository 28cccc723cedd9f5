"""The gradient buffer of one flat group: where its gradients live between backward and step.

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

The ``param.grad`` markers this buffer places are in grad_markers.py ([Note: param.grad
after backward]).
"""

from __future__ import annotations

import enum

import torch

from .._comm.collectives import Collectives, Handle
from .._mechanisms.host_pool import storage_use_count
from .grad_markers import GradMarkers


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
        self.markers = GradMarkers(n)  # See [Note: param.grad after backward] in grad_markers.py

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
