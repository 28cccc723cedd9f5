"""Gathers over several flat groups at once: a stage-3 unit's, and the step's of groups kept whole.

Each :class:`~.flat.FlatGroup` knows how to make room for its ``full`` and where its gather
source is; this module issues the collectives over a list of them, one coalesced call where
they travel together (See [Note: coalesced collectives] in _comm/collectives.py). Kept apart
from flat.py because it is about batching groups, not about one group's layout or states.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from .._comm.collectives import Collectives
from .flat import preserve_version

if TYPE_CHECKING:
    from .flat import FlatGroup


class _DeferredHandle:
    """A gather whose collective is issued at ``wait()`` (its disk read is already running)."""

    __slots__ = ("_start",)

    def __init__(self, start):
        self._start = start

    def wait(self) -> None:
        if self._start is not None:
            start, self._start = self._start, None
            start().wait()


def begin_gather_groups(groups: list["FlatGroup"], comm: Collectives, label: str):
    """Start one all-gather of the ``groups`` not gathered yet (several: coalesced, See [Note:
    coalesced collectives] in _comm/collectives.py); None when all are gathered. Where a shard
    rests on NVMe, the reads start now and the collective is issued at ``wait()``, in the
    same order on every rank (``_DeferredHandle``)."""
    opened = [g for g in groups if g.open_for_gather()]
    if not opened:
        return None
    name = opened[0].name if len(opened) == 1 else label

    def start():
        with contextlib.ExitStack() as stack:
            for g in opened:
                stack.enter_context(preserve_version(g.full))
            sources = [g.gather_source() for g in opened]
            return comm.all_gather_coalesced([g.full for g in opened], sources, label=name)
    if any(g.params.needs_deferred_gather for g in opened):
        return _DeferredHandle(start)
    return start()


#: the step's all-gathers of groups kept whole are coalesced up to this many elements per call (4 MiB
#: in fp32): small groups (stage 3's persistent ones, biases and norms) cost a collective's fixed
#: cost each, while above it one group's own bytes outweigh it and the copies in and out would only
#: add to them. See [Note: coalesced collectives] in _comm/collectives.py.
COALESCE_STEP_ELEMENTS = 1 << 20


def publish_masters(groups: list["FlatGroup"], comm: Collectives) -> list:
    """:meth:`FlatGroup.publish_master` for each of ``groups``, with the all-gathers of neighbours that
    fit :data:`COALESCE_STEP_ELEMENTS` together issued as one. Returns the handles to wait for."""
    return _coalesced_gathers([(g, g.publish_local()) for g in groups], comm)


def gather_replicated_groups(groups: list["FlatGroup"], comm: Collectives) -> list:
    """Stages 1-2 and persistent stage-3 groups (the offloaded step): all-gather each ``full`` from its
    own slice, coalesced as :func:`publish_masters`."""
    return _coalesced_gathers([(g, None if g.shard_params else g.own(g.full)) for g in groups], comm)


def _coalesced_gathers(sources: list, comm: Collectives) -> list:
    """All-gather each group's ``full`` from its own slice (pairs ``(group, own)``; own None: nothing to
    gather), neighbours together up to :data:`COALESCE_STEP_ELEMENTS` per collective."""
    handles, batch, size = [], [], 0

    def issue() -> None:
        if batch:
            label = batch[0][0].name if len(batch) == 1 else f"{batch[0][0].name} +{len(batch) - 1} groups"
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for g, _ in batch:
                    stack.enter_context(preserve_version(g.full))
                handles.append(comm.all_gather_coalesced([g.full for g, _ in batch], [o for _, o in batch],
                                                         label=label))
            batch.clear()

    for g, own in sources:
        if own is None:
            continue
        if size + g.padded_numel > COALESCE_STEP_ELEMENTS:
            issue()
            size = 0
        batch.append((g, own))
        size += g.padded_numel
    issue()
    return handles
