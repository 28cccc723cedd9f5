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

The order is one of *buckets*, not of groups: a bucket is the trainable groups of one
unit, its small groups reduced as one coalesced reduce-scatter (See [Note: coalesced
collectives] in _comm/collectives.py) and each large one on its own, right before them
(:data:`COALESCE_REDUCE_ELEMENTS`), so many small flat groups (members of an expert list,
the root's parts, a persistent group beside the sharded one) cost one collective. A
bucket is launched once all of its groups are complete on this rank, or at the end of
backward; a group with no gradient on this rank (an expert its
batch skipped) holds its bucket to the end of backward, as it held every group after
it in the order before buckets, and contributes zeros. Stage 1 reduces in place, at
the step, one group at a time (its buckets are single groups).

The queue keeps at most :data:`MAX_IN_FLIGHT` reduce-scatters in flight (one with
``overlap_step``, whose step starts as each one finishes) and calls ``on_reduced``
for each group of each one finished during backward.
"""

from __future__ import annotations

import collections
from typing import Callable

import torch

from .._comm.collectives import CollectiveError, Collectives, Handle
from .flat import FlatGroup
from .units import missing_ranks_message

#: reduce-scatters allowed in flight during backward before the oldest is waited on
MAX_IN_FLIGHT = 4

#: a unit's trainable groups up to this many elements (1 MiB of fp32 gradients) share one coalesced
#: reduce-scatter; a larger group has its own. Coalescing copies each gradient into a packed buffer
#: in the backward hook, on the compute path, while a collective's own cost runs beside backward:
#: on the 4-block GPT-2 of benchmarks/cpu_bench.py (2 gloo ranks, stage 3), coalescing each block's
#: 720,896-element group with its 68,864-element one made backward 15-20 ms slower per step, though
#: alone the coalesced pair is faster. Small groups (an expert list's members, the root's parts, a
#: block's biases and norms) gain: each saves a call and costs little to copy.
COALESCE_REDUCE_ELEMENTS = 1 << 18


class ReduceQueue:
    """Launches, limits and finishes the gradient reduce-scatters of one engine's groups."""

    def __init__(self, comm: Collectives, buckets: list[tuple[str, list[FlatGroup]]], in_place: bool,
                 in_flight_limit: Callable[[], int], on_reduced: Callable[[FlatGroup], None]):
        """``buckets``: (unit name, its trainable groups) in registration order. ``in_place``: stage 1
        reduces into its persistent full buffer, one group at a time. ``on_reduced(group)``: a
        reduce finished during backward."""
        self.comm = comm
        self.in_place = in_place
        if in_place:
            buckets = [(g.name, [g]) for _, groups in buckets for g in groups]
        #: See [Note: reduce order]
        self.order: list[tuple[str, list[FlatGroup]]] = [(n, gs) for n, gs in reversed(buckets) if gs]
        self._position = {id(g): i for i, (_, gs) in enumerate(self.order) for g in gs}
        self._in_flight_limit = in_flight_limit
        self._on_reduced = on_reduced
        self.pending: collections.deque[tuple[list[FlatGroup], Handle, list[torch.Tensor], str]] = (
            collections.deque())
        # per backward (reset by end_backward)
        self._next = 0            # position in ``order`` of the next bucket to launch
        self._complete: dict[int, set[int]] = {}  # position -> ids of its groups complete on this rank

    # ------------------------------------------------------------ in backward
    def complete(self, group: FlatGroup) -> None:
        """This rank holds all of ``group``'s gradients: launch its bucket once the bucket is complete,
        and whatever that unblocks, in order."""
        position = self._position[id(group)]
        if position < self._next:  # a second round in this backward: See [Note: reduce order]
            self.launch([group])
            return
        self._complete.setdefault(position, set()).add(id(group))
        while self._next < len(self.order) and len(self._complete.get(self._next, ())) == len(
                self.order[self._next][1]):
            del self._complete[self._next]
            self._launch_bucket(self._next)
            self._next += 1

    def flush(self) -> None:
        """End of backward: launch every bucket not launched yet, in order (zeros where unused)."""
        while self._next < len(self.order):
            self._launch_bucket(self._next)
            self._next += 1
        self._complete.clear()

    def end_backward(self) -> None:
        self._next = 0
        self._complete.clear()

    # --------------------------------------------------------------- launches
    def _launch_bucket(self, position: int) -> None:
        name, groups = self.order[position]
        groups = [g for g in groups if not g.grads.reduced_this_backward]
        if groups:
            self.launch(groups, name)

    def launch(self, groups: list[FlatGroup], name: str | None = None) -> None:
        """Start the reduce-scatters of ``groups`` now (the caller keeps the order; see the Note): each
        group above :data:`COALESCE_REDUCE_ELEMENTS` on its own, in place, and the others as one per
        gradient dtype (a sum runs in one dtype: an fp32-kept group's gradients coalesced with bf16 ones
        would be summed in bf16)."""
        dtypes = list(dict.fromkeys(g.grads.grad_dtype for g in groups))
        if len(dtypes) > 1:
            for dtype in dtypes:
                self.launch([g for g in groups if g.grads.grad_dtype == dtype], name)
            return
        if self.in_place or len(groups) == 1:
            self._launch_one(groups, name)
            return
        small = [g for g in groups if g.padded_numel <= COALESCE_REDUCE_ELEMENTS]
        for g in groups:
            if g.padded_numel > COALESCE_REDUCE_ELEMENTS:
                self._launch_one([g], name)
        if small:
            self._launch_one(small, name)

    def _launch_one(self, groups: list[FlatGroup], name: str | None) -> None:
        label = groups[0].name if len(groups) == 1 else f"{name} ({len(groups)} groups)"
        with torch.profiler.record_function(f"zero::reduce::{label}"):
            if len(groups) == 1:  # full_grad stays (and is counted) until finish_reduce frees it
                handle, out = groups[0].grads.begin_reduce(self.comm, in_place=self.in_place)
                outs = [out]
            else:
                fulls = [g.grads.prepare_reduce(self.comm) for g in groups]
                handle, outs = self.comm.reduce_scatter_coalesced(fulls, label=label)
                for g in groups:  # copied into the packed input: their buffers can go now
                    g.grads.now_reducing(drop_full=True)
        self.pending.append((groups, handle, outs, label))
        limit = self._in_flight_limit()
        while len(self.pending) > limit:
            self.finish_one()

    def finish_one(self, notify: bool = True) -> None:
        groups, handle, outs, label = self.pending.popleft()
        with torch.profiler.record_function(f"zero::reduce_wait::{label}"):
            try:
                handle.wait()
            except CollectiveError as e:
                raise missing_ranks_message(
                    self.comm, f"the gradient reduce-scatter of {label!r}", e, gather=False) from e
        for group, out in zip(groups, outs):
            group.finish_reduce(out, self.comm, in_place=self.in_place)
        if notify:
            for group in groups:
                self._on_reduced(group)

    def wait_all(self, notify: bool = True) -> None:
        while self.pending:
            self.finish_one(notify)
