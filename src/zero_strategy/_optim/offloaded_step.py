"""The offloaded step: the user's optimizer on the host, pipelined with uploads and gathers.

With the fp32 masters in host memory (CPU offload) or on NVMe, a step is a pipeline
per batch of groups: download the reduced gradient, step on the CPU worker thread,
upload the new values, all-gather them. The worker steps batch i+1 while batch i
uploads and gathers (See [Note: step batches] in _mechanisms/transfers.py); with the
optimizer state on NVMe each batch reads its state ahead and writes it back.

[Note: overlap_step]
With ZeroConfig(overlap_step=True) a synced backward is the last micro-batch of a
step (the user said so), so a group whose gradients are reduced is final: the engine
tells every optimizer (``group_reduced``), and the one that owns the group starts its
CPU step on the worker thread while backward goes on. ``step()`` then only waits for
those steps and issues the all-gathers, in group order on every rank (collectives
never leave the main thread).
"""

from __future__ import annotations

import concurrent.futures
import sys
from typing import TYPE_CHECKING, Any, Callable

import torch

from .._engine.units import gather_replicated_groups
from .._mechanisms.cast_scratch import carve
from .._mechanisms.transfers import step_batches
from .adam_windows import step_in_windows, window_plan
from .chunked_step import step_in_chunks
from .owned_runs import step_owned_runs

if TYPE_CHECKING:
    from .._engine.engine import ZeroEngine


class OffloadedStep:
    """One optimizer's host-side step over its groups, and the group steps overlap_step starts early.

    ``step_masters(groups, window=None)``: the user's optimizer stepping those groups' masters
    (the ZeroOptimizer's, so hooks and the untouched-parameter rule stay in one place).
    ``states()``: the user's optimizer's ``state`` mapping now (a ``load_state_dict`` replaces it).
    """

    def __init__(self, engine: "ZeroEngine", groups: list, step_masters: Callable[..., None],
                 states: Callable[[], dict],
                 set_grad: Callable[[Any, torch.Tensor | None], None] | None = None,
                 group_state: Callable[[Any], dict] | None = None,
                 owned_views: Callable[[Any], list] | None = None,
                 optimizer: Callable[[], torch.optim.Optimizer] | None = None):
        """``set_grad(group, grad)``: hand the optimizer a group's fp32 gradient (None: take it back):
        the master's ``.grad``, or views of it per parameter (See [Note: optimizers that need whole
        tensors] in optimizer.py). ``group_state(group)``: the group's optimizer state its master's
        store swaps; ``owned_views(group)``: an owned group's (slot, where, view) per parameter;
        ``optimizer()``: the user's optimizer (an owned group's step in runs reads its state)."""
        self.engine = engine
        self.groups = groups
        self._step_masters = step_masters
        self._set_grad = set_grad or (lambda g, grad: setattr(g.master, "grad", grad))
        self._states = states
        self._group_state = group_state or (lambda g: self._states().get(g.master, {}))
        self._owned_views, self._optimizer = owned_views, optimizer
        self._early: dict[int, concurrent.futures.Future] = {}  # id(group) -> its CPU step during backward
        self.steps_overlapped = 0  # group steps started during backward so far (overlap_step)
        engine.transfers.pool  # its worker starts now, at setup, not in a backward hook (_mechanisms/transfers.py)
        if engine.swap is not None:  # slots of its own for the reads backward starts
            pool = engine.swap.pool  # See [Note: NVMe state read during backward]
            pool.grow_to(pool.count + engine.swap.policy.read_ahead + 1)

    def collect_early(self) -> None:
        """Wait for the group steps overlap_step started, and forget them (``zero_grad``)."""
        for fut in self._early.values():
            concurrent.futures.wait([fut])
        self._early.clear()

    def group_reduced(self, group) -> None:
        """The engine reduced ``group`` (one of ours) during a synced backward: step it now.

        See [Note: overlap_step].
        """
        if id(group) in self._early:
            return
        self._early[id(group)] = self.engine.transfers.pool.submit(self._cpu_step_groups, (group,), 1.0)
        self.steps_overlapped += 1

    def on_backward_started(self, synced: bool) -> None:
        """The engine began a backward (``synced``: outside ``no_sync``): read the step's state
        ahead now, unless backward's own gathers read parameters from the swap file
        (``engine.backward_reads_swap``), which then wait for :meth:`on_last_gathers_issued`."""
        if not self.engine.backward_reads_swap:
            self._read_step_state_ahead(synced)

    def on_last_gathers_issued(self, synced: bool) -> None:
        """The engine began backward's last stage-3 gathers: backward needs nothing more from the disk."""
        self._read_step_state_ahead(synced)

    def _read_step_state_ahead(self, synced: bool) -> None:
        """Backward needs nothing more from the disk: start reading the state the step needs
        first. At the start of backward, or (when backward's gathers read parameters from
        NVMe) once its last gathers have begun: read earlier, the step's large reads queue
        ahead of the parameters backward waits for (measured: backward +35%, RESULTS.md).
        Not for a ``no_sync`` micro-batch (no step follows) nor with overlap_step."""
        if self.engine.swap is not None and synced and not self.engine.overlap_step:
            self.prefetch_step_state()

    def prefetch_step_state(self) -> None:
        """A synced backward began: start reading the state the step will need first.

        [Note: NVMe state read during backward]
        With the optimizer state on NVMe the step used to begin with a read of its first
        group's state (master and moments, 12 bytes per parameter): the disk was idle
        through backward, then the step waited on it. Backward now starts the reads of the
        first ``read_ahead + 1`` groups in step order (at stage 3 the root's, then the
        embeddings' when they are a unit: often large), so they arrive under backward's compute.
        When: as soon as backward needs nothing more from the disk (the engine tells
        :meth:`on_backward_started` and :meth:`on_last_gathers_issued`; this side decides): at its start, or at stage 3 with parameters on NVMe
        once its last gathers have begun, so that the step's large reads do not queue
        ahead of the parameter reads backward waits on.

        This holds those slots from backward to the step. Each optimizer adds
        ``read_ahead + 1`` slots to the pool for them, so neither backward's own parameter
        reads nor another optimizer's step (several optimizers over one model) wait on a
        slot that only this optimizer's step would give back. Only for a synced backward (a ``no_sync`` micro-batch is
        not followed by a step) and not with overlap_step (its steps start in backward and
        read their own state). A read whose step does not come keeps its slot until the
        next step uses it; a group that gets no gradient gives its read up in the step. A
        set read here is only ever used if nothing wrote it since: every writer (a step, a
        checkpoint load) goes through NVMeStore, which drops a read in flight before it
        writes (``_cancel_prefetch``).
        """
        if self.engine.swap is None:
            return
        first = [g for g in self.groups if g.masters is not None]
        for g in first[:self.engine.swap.policy.read_ahead + 1]:
            g.masters.prefetch()

    @property
    def steps_in_flight(self) -> bool:
        """overlap_step: group steps started during the last backward that ``step()`` has not collected."""
        return bool(self._early)

    def stepped_early(self, group) -> bool:
        """Whether ``group`` already stepped during the last backward (its gradients are final)."""
        return id(group) in self._early

    def step(self, factor: float, early_only: bool = False) -> None:
        """CPU step, pipelined: the worker steps batch i+1 while batch i uploads and gathers.

        Stepping some groups at a time with the user's optimizer is exact: only those
        groups' masters have a ``.grad``, and torch optimizers skip parameters without
        one (all state is per parameter). See [Note: step batches]. A group that stepped
        during backward is uploaded and gathered even when the agreement then found no
        gradient for it on any rank, or the replicas would differ. ``early_only``: only
        those groups (See [Note: a step overlap_step began is not undone] in optimizer.py).
        """
        groups = [g for g in self.groups
                  if id(g) in self._early or (not early_only and g.grads.grad_shard is not None)]
        for g in self.groups:  # state read during backward for a group with no gradient: not needed
            if g.grads.grad_shard is None and g.masters is not None:
                g.masters.cancel_prefetch()
        pool = self.engine.transfers.pool
        read_ahead = self.engine.swap.policy.read_ahead if self.engine.swap is not None else 0
        early, self._early = self._early, {}
        jobs = []  # (groups, future of their upload events), in group order
        for batch, rest in step_batches(groups, early, limit=self._batch_limit(groups)):
            fut = early.pop(id(batch[0]), None) if len(batch) == 1 else None
            jobs.append((batch, fut or pool.submit(self._cpu_step_groups, batch, factor, rest[:read_ahead])))
        handles = []
        try:
            for batch, fut in jobs:
                for uploaded in fut.result():
                    if uploaded is not None:
                        uploaded.wait()  # the compute stream waits for the H2D copy
                handles += gather_replicated_groups(batch, self.engine.comm)  # coalesced where small
        finally:
            for _, fut in jobs:  # never leave the worker running past an error
                concurrent.futures.wait([fut])
            if self.engine.swap is not None:
                self.engine.swap.wait_writes()  # surfaces write errors; the next step reads what was written
        for h in handles:
            if h is not None:
                h.wait()

    def _batch_limit(self, groups) -> int | None:
        """The step batches' size: :data:`STEP_BATCH_NUMEL` (None) where the main thread has work
        to overlap with the next batch's step (uploads to a GPU; all-gathers of replicated
        parameters across ranks) or where each batch casts its gradients (bounded by the batch:
        See [Note: fp32 gradients only for the groups being stepped] in _engine/storage.py);
        otherwise one batch, since each optimizer call costs its dispatch and a hand-off (the
        36-48M-parameter step of benchmarks/hot_path.py: 0.86-0.92x torch's fused AdamW in
        batches, 0.99-1.03x in one). The windowed step casts a window at a time, whatever the
        batch, so it is one batch too (See [Note: the bf16 step in cache-sized windows] in
        adam_windows.py). See [Note: step batches] in _mechanisms/transfers.py."""
        overlaps = self.engine.transfers.cuda or (not self.engine.plan.shards_parameters
                                                   and self.engine.comm.world_size > 1)
        casts = any(g.master_grad_cast_numel for g in groups) and self._window_plan(groups) is None
        return None if overlaps or casts else sys.maxsize

    def _cpu_step_groups(self, batch, factor: float, upcoming=()) -> list:
        """On the CPU worker: one optimizer step over ``batch``'s masters (state read ahead
        for ``upcoming`` groups). Returns each group's upload event (or None). What it frees it
        keeps for the next step: See [Note: releases where a phase ends] in
        _mechanisms/memory.py."""
        chunked = batch[0].masters.streams and not batch[0].owned  # casts chunk by chunk, in step_in_chunks
        # casts window by window (See [Note: the bf16 step in cache-sized windows] in adam_windows.py)
        windowed = None if chunked else self._window_plan(batch)
        casts = 0 if chunked or windowed else sum(g.master_grad_cast_numel for g in batch)
        scratch = self.engine.transfers.cast_scratch.take(casts, torch.float32)
        try:
            return self._cpu_step_batch(batch, factor, upcoming, scratch, windowed)
        finally:  # the step's slices of it are gone with its frame
            self.engine.transfers.cast_scratch.give_back(scratch)

    def _window_plan(self, batch) -> list | None:
        """The batch as the windowed Adam step takes it, or None: See [Note: the bf16 step in
        cache-sized windows] in adam_windows.py. Not for masters that visit a swap slot for the
        step (NVMe): their state is only resident inside it."""
        if self._optimizer is None or not all(g.masters.steps_together for g in batch):
            return None
        return window_plan(self._optimizer(), batch)

    @torch.no_grad()
    def _cpu_step_batch(self, batch, factor: float, upcoming=(), scratch: torch.Tensor | None = None,
                        windowed: list | None = None) -> list:
        """``scratch``: where the batch's gradient casts go (See [Note: the step's casts reuse
        their buffers] in _mechanisms/cast_scratch.py); ``windowed``: the batch's plan for the
        windowed Adam step (See [Note: the bf16 step in cache-sized windows] in adam_windows.py)."""
        take = carve(scratch)
        cast_into = lambda g: take(g.master_grad_cast_numel)  # noqa: E731
        with torch.profiler.record_function(f"zero::cpu_step::{batch[0].name}+{len(batch) - 1}"):
            for nxt in upcoming:  # read-ahead: the next groups' state loads while this one steps
                nxt.masters.prefetch()
            if batch[0].masters.streams:  # larger than a staging slot: one group, chunk by chunk
                if batch[0].owned:  # See [Note: the ownership layout on NVMe] in owned_runs.py
                    grad = batch[0].master_grad(cast_into(batch[0]))
                    if factor != 1.0:
                        grad.mul_(factor)
                    return [step_owned_runs(batch[0], grad, self._owned_views(batch[0]), self._step_masters,
                                            self._optimizer())]
                # cast (and scaled) chunk by chunk: See [Note: fp32 gradients only for the groups being stepped]
                return [step_in_chunks(batch[0], batch[0].master_grad_source(), factor, self._step_masters,
                                       self._states(), self.engine.transfers.cast_scratch)]
            begun = []
            try:
                for g in batch:
                    g.masters.begin_step()
                    begun.append(g)
                if windowed is not None:
                    uploads = step_in_windows(windowed, factor, self.engine.transfers.cast_scratch)
                else:
                    uploads = self._step_and_stage(batch, factor, cast_into)
            except BaseException:
                for g in begun:
                    g.masters.abort_step()  # hand the slot back unwritten, or the next step waits forever
                raise
            for g in batch:
                g.masters.end_step(self._group_state(g))
            return uploads

    def _step_and_stage(self, batch, factor: float, cast_into) -> list:
        """The user's optimizer over ``batch`` (each group's fp32 gradient cast into ``cast_into(g)``
        and scaled by ``factor``), then each group's new master staged for upload: the upload events."""
        for g in batch:
            grad = g.master_grad(cast_into(g))  # waits for this group's download only
            if factor != 1.0:
                grad.mul_(factor)
            self._set_grad(g, grad)
        try:
            self._step_masters(batch)
        finally:
            for g in batch:
                self._set_grad(g, None)
        return [g.stage_master_upload() for g in batch]

