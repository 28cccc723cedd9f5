"""The reduce queue: gradient reduce-scatters in one order that every rank agrees on.

[Note: reduce order]
A group's reduce-scatter may start once this rank holds all of its gradients. Which
groups are complete, and when, depends on what this rank's batch used: an expert its
samples never reached, an image tower its text-only batch skipped, blocks after an
early exit. Launched in completion order, two ranks issue their reduce-scatters in
different orders, and a backend pairs the k-th collective of each rank: two groups of
one size are summed into each other silently, two of different sizes hang. So the
launches follow one fixed order, the same on every rank (``order``: the trainable
groups in reverse registration order, the order in which backward completes them in
a model whose blocks run in registration order). A complete group waits until every
group before it in that order was launched; the end of backward launches what is
left, in that order, and a group with gradients missing on this rank contributes
zeros for them: the mean over ranks with zeros from the ranks that did not use a
parameter, which is what DDP with ``find_unused_parameters=True`` computes. In a
model whose ranks all use every parameter, backward completes the groups in this
order anyway, and nothing waits.

Gradients that arrive for a group already launched in this backward (the nested
backward of reentrant checkpointing, see [Note: reentrant checkpointing and units
called twice] in _engine/engine.py) are a second round: launched at once, as every rank
does the same there.

The queue keeps at most :data:`MAX_IN_FLIGHT` reduce-scatters in flight (one with
``overlap_step``, whose step starts as each one finishes) and calls ``on_reduced``
for each one finished during backward.
"""

from __future__ import annotations

import collections
from typing import Callable

import torch

from ._collectives import CollectiveError, Collectives, Handle
from ._flat import FlatGroup
from ._units import missing_ranks_message

#: reduce-scatters allowed in flight during backward before the oldest is waited on
MAX_IN_FLIGHT = 4


class ReduceQueue:
    """Launches, limits and finishes the gradient reduce-scatters of one engine's groups."""

    def __init__(self, comm: Collectives, groups: list[FlatGroup], in_place: bool,
                 in_flight_limit: Callable[[], int], on_reduced: Callable[[FlatGroup], None]):
        """``groups``: the trainable groups in registration order. ``in_place``: stage 1 reduces into
        its persistent full buffer. ``on_reduced(group)``: a reduce finished during backward."""
        self.comm = comm
        self.in_place = in_place
        self.order: list[FlatGroup] = list(reversed(groups))  # See [Note: reduce order]
        self._position = {id(g): i for i, g in enumerate(self.order)}
        self._in_flight_limit = in_flight_limit
        self._on_reduced = on_reduced
        self.pending: collections.deque[tuple[FlatGroup, Handle, torch.Tensor]] = collections.deque()
        # per backward (reset by end_backward)
        self._next = 0            # position in ``order`` of the next group to launch
        self._complete: set[int] = set()  # positions complete on this rank, not launched yet

    # ------------------------------------------------------------ in backward
    def complete(self, group: FlatGroup) -> None:
        """This rank holds all of ``group``'s gradients: launch it and whatever it unblocks, in order."""
        position = self._position[id(group)]
        if position < self._next:  # a second round in this backward: See [Note: reduce order]
            self.launch(group)
            return
        self._complete.add(position)
        while self._next in self._complete:
            self._complete.discard(self._next)
            self.launch(self.order[self._next])
            self._next += 1

    def flush(self) -> None:
        """End of backward: launch every group not launched yet, in order (zeros where unused)."""
        while self._next < len(self.order):
            group = self.order[self._next]
            self._next += 1
            if not group.grads.reduced_this_backward:
                self.launch(group)
        self._complete.clear()

    def end_backward(self) -> None:
        self._next = 0
        self._complete.clear()

    # --------------------------------------------------------------- launches
    def launch(self, group: FlatGroup) -> None:
        """Start ``group``'s reduce-scatter now (the caller keeps the order; see the Note)."""
        with torch.profiler.record_function(f"zero::reduce::{group.name}"):
            handle, out = group.grads.begin_reduce(self.comm, in_place=self.in_place)
        self.pending.append((group, handle, out))
        limit = self._in_flight_limit()
        while len(self.pending) > limit:
            self.finish_one()

    def finish_one(self, notify: bool = True) -> None:
        group, handle, out = self.pending.popleft()
        with torch.profiler.record_function(f"zero::reduce_wait::{group.name}"):
            try:
                handle.wait()
            except CollectiveError as e:
                raise missing_ranks_message(
                    self.comm, f"the gradient reduce-scatter of {group.name!r}", e, gather=False) from e
        group.finish_reduce(out, self.comm, in_place=self.in_place)
        if notify:
            self._on_reduced(group)

    def wait_all(self, notify: bool = True) -> None:
        while self.pending:
            self.finish_one(notify)
