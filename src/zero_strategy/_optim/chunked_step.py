"""The optimizer step of one streamed group, chunk by chunk.

[Note: a step in chunks is the step]
A flat group whose master and optimizer state are larger than one NVMe staging slot is
stepped as consecutive chunks [a, b) of its shard (See [Note: bounded staging] in
_mechanisms/nvme_stream.py). Setup only accepts elementwise optimizers (See [Note: why
re-home instead of wrap] in optimizer.py): each element's update reads that element of the
master, gradient and state tensors, and the group's hyperparameters and shared scalars
(Adam's ``step``). So the user's optimizer is called once per chunk with the master, its
``.grad`` and its elementwise state viewing that chunk, and the shared scalars put back to
their values before the step for every chunk but the first: each chunk sees exactly the
values one call on the whole shard would, and after the last chunk the scalars have moved
once. At the group's first step the optimizer has no state yet: each chunk starts from
none, as the optimizer would start the whole shard (its initial values are elementwise:
zeros, or a constant of the group's settings), and the chunk's new state goes to the swap
file. tests/test_nvme_streaming.py compares the chunks with one call on the whole tensor,
fused and foreach kernels included.

If a chunk's step raises, the chunks before it are already written: the swap file holds
half a step, so the store is marked failed (no later read can return it) and the error
says to restart from a checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch

from .._engine.storage import fp32_grad
from .._mechanisms.cast_scratch import CastScratch
from .._mechanisms.nvme import NVMeError


def stopped_part_way(masters, what: str, e: BaseException) -> NVMeError:
    """The error of a streamed step that failed after writing part of its state back: ``masters``
    (the group's NVMe masters) is marked failed with it, so the next step refuses instead of
    training on from half-updated state. ``what``: the group and how it was streamed."""
    err = NVMeError(f"the optimizer step of {what} from the NVMe swap file, stopped part way "
                    f"({type(e).__name__}: {e}); the swap file holds part of a step, so it is not read "
                    "again. Restart from the last checkpoint")
    masters.fail(err)
    return err


def chunk_grad(grad: torch.Tensor, dtype: torch.dtype, factor: float, into: torch.Tensor | None = None) -> torch.Tensor:
    """One chunk's gradient as the optimizer takes it: cast to the master's ``dtype`` (into
    ``into`` when given), scaled by ``factor``. An fp32 chunk is scaled where it is, as the
    whole shard was before chunks."""
    out = fp32_grad(grad, dtype, into)
    if factor != 1.0:
        out.mul_(factor)
    return out


def _step_chunk(group, a: int, b: int, views: dict, fresh: bool, swapped, before: dict, state, states: dict,
                step_masters: Callable[..., None]) -> None:
    """One chunk [a, b) of ``group``'s shard stepped, its master and ``.grad`` already set: the
    optimizer state viewing the chunk (or, at the first step, the chunk's new state kept)."""
    master, masters = group.master, group.masters
    if fresh:
        states.pop(master, None)  # the optimizer starts this chunk as it starts a shard
    else:
        for k in swapped:
            state[k].data = views[f"state.{k}"]
        if a:
            state.update(copy.deepcopy(before))
    step_masters([group], window=(a, b))
    if fresh:
        for k, v in states[master].items():
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == b - a:
                masters.keep_state_chunk(k, v, a, views)


class _Events:
    """The upload events of one group's chunks, waited for together."""

    def __init__(self, events: list):
        self.events = [e for e in events if e is not None]

    def wait(self, stream=None) -> None:
        for e in self.events:
            e.wait(stream)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


@torch.no_grad()
def step_in_chunks(group, grad: torch.Tensor, factor: float, step_masters: Callable[..., None],
                   states: dict, scratch: CastScratch | None = None) -> _Events:
    """Step ``group`` (its reduced gradient ``grad`` [shard] in the reduce dtype, to be scaled by
    ``factor``) chunk by chunk, and write each chunk's new parameter shard. Each chunk's gradient
    is cast to fp32 and scaled on its own (See [Note: fp32 gradients only for the groups being
    stepped] in _engine/storage.py), into a buffer taken from ``scratch`` when given (See [Note:
    the step's casts reuse their buffers] in _mechanisms/cast_scratch.py); the values are those
    of a cast and scale of the whole shard. See [Note: a step in chunks is the step]."""
    masters, master = group.masters, group.master
    masters.cancel_prefetch()  # a whole-set read started before the set outgrew a slot: not used
    state = states.get(master)
    swapped = masters.swapped_state()
    fresh = not state or not swapped
    # the shared scalars (Adam's step) as they are before the step: every chunk starts from them
    before = {} if fresh else {k: copy.deepcopy(v) for k, v in state.items() if k not in swapped}
    events = []
    chunks = masters.stream(fresh)
    into = None  # the cast buffer, grown to the largest chunk
    try:
        with contextlib.closing(chunks):
            for a, b, views in chunks:
                master.data = views["master"]
                if scratch is not None and grad.dtype != master.dtype and (into is None or into.numel() < b - a):
                    scratch.give_back(into)
                    into = scratch.take(b - a, master.dtype)
                master.grad = chunk_grad(grad[a:b], master.dtype, factor, None if into is None else into[:b - a])
                _step_chunk(group, a, b, views, fresh, swapped, before, state, states, step_masters)
                events.append(group.params.take_master(views["master"], group.transfers, start=a))
    except BaseException as e:
        raise stopped_part_way(masters, f"flat group {group.name!r}, streamed in chunks", e) from e
    finally:
        master.grad = None
        if scratch is not None:
            scratch.give_back(into)
        master.data = torch.empty(0, dtype=master.dtype)
        for k, v in states.get(master, {}).items():
            if k in swapped or k in masters.swapped_state():
                v.data = torch.empty(0, dtype=v.dtype)
    return _Events(events)
