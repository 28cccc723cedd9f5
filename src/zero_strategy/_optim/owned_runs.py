"""The optimizer step of an owned group on NVMe: whole parameters, a run of them at a time.

[Note: the ownership layout on NVMe]
An owned group (See [Note: the ownership layout] in _engine/flat.py) keeps the fp32 master
shard in the swap file as a flat group does, and beside it each state tensor of each
parameter this rank owns, whole and of its own shape (``state.p{slot}.{key}``: Muon's
momentum, Adafactor's row and column statistics, a quantized optimizer's bytes and scales;
0-d counts stay in memory as Adam's ``step`` does, and so do tensors the optimizer shares
between parameters, such as bitsandbytes' quantization maps). The views the optimizer steps, one per
owned parameter, follow the master in and out of the swap file (``NVMeStore.alias``): they
view it while it is resident and are empty while it is evicted.

A group that fits a staging slot is stepped as a flat one is: master and every state tensor
come in whole, the optimizer steps the views, the set is written back. A larger one is not
cut into element ranges, as a flat group's chunked step cuts it (See [Note: a step in chunks
is the step] in chunked_step.py): an element range would split a matrix, and Muon and
Adafactor need each whole. It is stepped in *runs*: consecutive parameters this rank owns
whose master elements and state fit in one slot, a parameter larger than a slot alone in a
buffer of its own size (as checkpoints read large sets, ``SlotPool.acquire_private``).
Each run reads the master elements it covers, rounded out to ``ALIGN_ELEMS`` so that every
request stays aligned for O_DIRECT, and its parameters' state tensors whole; the optimizer
steps the run's views, and the run is written back before the next is read. Two runs can
share the aligned block at their boundary, and the next run reads that block only once the
previous one's write is done, so the elements it writes back for its neighbour are the
neighbour's new ones. This serializes reads and writes (no read ahead inside the group):
the price of whole parameters in bounded staging.
"""

from __future__ import annotations

import torch

from .._mechanisms import nvme_stream
from .chunked_step import _Events, stopped_part_way

#: bytes per element a run is planned with before its state exists (master and two moments)
PLANNED_BYTES = 12


def owned_state(states: dict, views, shared: frozenset[int] = frozenset()) -> dict[str, torch.Tensor]:
    """The optimizer state of an owned group's views, keyed ``p{slot}.{key}``, less the tensors
    ``shared`` (ids) that the optimizer shares between parameters (:func:`shared_tensors`)."""
    return {f"p{s.index}.{k}": v for s, _, view in views for k, v in states.get(view, {}).items()
            if id(v) not in shared}


def shared_tensors(optimizer: torch.optim.Optimizer) -> frozenset[int]:
    """Ids of the tensors ``optimizer`` holds outside its per-parameter state (an attribute, or a
    dict, list or tuple attribute): state entries that are the same object for several parameters,
    such as bitsandbytes' quantization maps (``name2qmap``, every parameter's ``qmap1``). They stay
    in memory: swapped out under one parameter, the object every other parameter shares would be
    emptied."""
    out = set()
    for name, value in vars(optimizer).items():
        if name in ("state", "param_groups", "defaults"):
            continue
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        out.update(id(t) for t in items if isinstance(t, torch.Tensor))
    return frozenset(out)


def plan_runs(views, slot_bytes: int | None) -> list[list]:
    """Consecutive owned parameters (in shard order) whose aligned master range, at
    ``PLANNED_BYTES`` per element, fits in one slot; a larger parameter makes a run alone."""
    runs, run = [], []
    align = nvme_stream.ALIGN_ELEMS
    for v in sorted(views, key=lambda v: v[1].start):
        if run:
            lo = run[0][1].start // align * align
            hi = -(-v[1].stop // align) * align
            if slot_bytes is None or PLANNED_BYTES * (hi - lo) <= slot_bytes:
                run.append(v)
                continue
            runs.append(run)
        run = [v]
    if run:
        runs.append(run)
    return runs


@torch.no_grad()
def step_owned_runs(group, grad: torch.Tensor, views, step_masters, optimizer: torch.optim.Optimizer
                    ) -> _Events:
    """Step owned group ``group`` (gradient ``grad`` [shard] fp32, already scaled) run by run, and
    write each run's new parameter elements. See [Note: the ownership layout on NVMe]."""
    masters, store = group.masters, group.swap
    masters.cancel_prefetch()
    untouched, group.grads.untouched = group.grads.untouched, frozenset()  # used once, as _set_grad does
    try:
        shared = shared_tensors(optimizer)
        for run in plan_runs(views, store.pool.slot_bytes):
            _step_run(group, run, grad, untouched, step_masters, optimizer, shared)
            store.wait_writes()  # the next run may share this run's last aligned block
    except BaseException as e:
        raise stopped_part_way(masters, f"owned group {group.name!r}, stepped a run of whole parameters at "
                               "a time", e) from e
    return _Events([])  # each run's parameter elements are written before the next run is read


def _step_run(group, run, grad: torch.Tensor, untouched: frozenset, step_masters,
              optimizer: torch.optim.Optimizer, shared: frozenset[int]) -> None:
    """Read one run, step its views, write master, state and parameter elements back."""
    store, masters, states = group.swap, group.masters, optimizer.state
    align, numel = nvme_stream.ALIGN_ELEMS, group.shard_numel
    a = run[0][1].start // align * align
    b = min(-(-run[-1][1].stop // align) * align, numel)
    keyed = [(s, view, k, t) for s, _, view in run for k, t in states.get(view, {}).items()
             if torch.is_tensor(t) and store.holds(group, "opt", f"state.p{s.index}.{k}", t)]
    parts = [("master", a, b)] + [(f"state.p{s.index}.{k}", 0, _state_numel(store, group, s.index, k))
                                  for s, _, k, t in keyed]
    buf, got = nvme_stream.read_parts(store, group, "opt", parts)
    try:
        for s, where, view in run:
            view.data = got["master"][where.start - a:where.stop - a].view(s.shape)
            view.grad = None if s.index in untouched else grad[where].view(s.shape)
        for s, _, k, t in keyed:
            t.data = got[f"state.p{s.index}.{k}"].view(store.shape_of(group, "opt", f"state.p{s.index}.{k}"))
        try:
            step_masters([group])
        finally:
            for _, _, view in run:
                view.grad = None
        nvme_stream.write_parts(store, group, "opt", buf, parts)
        uploaded = group.params.take_master(got["master"], group.transfers, start=a)
        if uploaded is not None:
            uploaded.synchronize()  # the buffer is given back below
        # a first step: its new state joins the swap file
        masters.track_optimizer_state(owned_state(states, run, shared))
    finally:
        for _, _, view in run:
            view.data = torch.empty(0, dtype=view.dtype)
        for _, _, _, t in keyed:
            t.data = torch.empty(0, dtype=t.dtype)
        store.pool.release(buf)


def _state_numel(store, group, index: int, key: str) -> int:
    """Elements of the swapped state tensor ``key`` of parameter ``index``."""
    return store.shape_of(group, "opt", f"state.p{index}.{key}").numel()
