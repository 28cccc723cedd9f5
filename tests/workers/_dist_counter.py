"""What this process's ``torch.distributed`` collectives move, counted outside zero_strategy.

The engine's own counters (``zs.comm_stats``) count what its ``Collectives`` object issues, so a
collective that bypasses it would be invisible to them. This module wraps the collectives of
``torch.distributed`` themselves, as FSDP2's tests do (``patch_all_gather``,
``patch_reduce_scatter``), and counts every call made through ``dist.<name>``, whichever path of
the package made it. ``install()`` must run before ``import zero_strategy``: the package binds
some of these functions when it is imported.

Counted per function, in elements of the full buffer each call covers (the ZeRO paper's
convention, the one the engine's counters use): an all-gather its output, a reduce-scatter its
input, a gather or scatter the whole of what the group exchanges (world size x this rank's
tensor), a broadcast, reduce or point-to-point call its tensor, an all-reduce twice its tensor
(DDP's all-reduce moves 2 x params). A call on a group of one rank moves nothing and counts
nothing. The object collectives (pickles) are counted as calls only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections import defaultdict

import torch.distributed as dist


def _numel(tensors) -> int:
    return sum(t.numel() for t in tensors)


def _dtype(tensors) -> str:
    return str(next(iter(tensors)).dtype).removeprefix("torch.") if tensors else "none"


def _group_size(a: dict) -> int:
    return dist.get_world_size(a.get("group"))


#: function -> (the tensors whose dtype it moves, the elements it covers), from its bound arguments
COVERED = {
    "all_gather_into_tensor": lambda a: ([a["output_tensor"]], a["output_tensor"].numel()),
    "all_gather_single": lambda a: ([a["output_tensor"]], a["output_tensor"].numel()),
    "_all_gather_base": lambda a: ([a["output_tensor"]], a["output_tensor"].numel()),
    "all_gather": lambda a: (a["tensor_list"], _numel(a["tensor_list"])),
    "all_gather_coalesced": lambda a: ([t for ts in a["output_tensor_lists"] for t in ts],
                                       sum(_numel(ts) for ts in a["output_tensor_lists"])),
    "reduce_scatter_tensor": lambda a: ([a["input"]], a["input"].numel()),
    "reduce_scatter_single": lambda a: ([a["input"]], a["input"].numel()),
    "_reduce_scatter_base": lambda a: ([a["input"]], a["input"].numel()),
    "reduce_scatter": lambda a: (a["input_list"], _numel(a["input_list"])),
    "all_reduce": lambda a: ([a["tensor"]], 2 * a["tensor"].numel()),
    "all_reduce_coalesced": lambda a: (a["tensors"], 2 * _numel(a["tensors"])),
    "broadcast": lambda a: ([a["tensor"]], a["tensor"].numel()),
    "reduce": lambda a: ([a["tensor"]], a["tensor"].numel()),
    "gather": lambda a: ([a["tensor"]], _group_size(a) * a["tensor"].numel()),
    "scatter": lambda a: ([a["tensor"]], _group_size(a) * a["tensor"].numel()),
    "all_to_all": lambda a: (a["input_tensor_list"], _numel(a["input_tensor_list"])),
    "all_to_all_single": lambda a: ([a["input"]], a["input"].numel()),
    "send": lambda a: ([a["tensor"]], a["tensor"].numel()),
    "recv": lambda a: ([a["tensor"]], a["tensor"].numel()),
    "isend": lambda a: ([a["tensor"]], a["tensor"].numel()),
    "irecv": lambda a: ([a["tensor"]], a["tensor"].numel()),
}
OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")

_counts: dict = defaultdict(lambda: {"calls": 0, "elements": defaultdict(int)})
_counting = [True]


def _wrap(name: str) -> None:
    real = getattr(dist, name)
    signature = inspect.signature(real)

    @functools.wraps(real)
    def counted(*args, **kwargs):
        if _counting[0]:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            entry = _counts[name]
            entry["calls"] += 1
            if name in COVERED and _group_size(bound.arguments) > 1:
                tensors, elements = COVERED[name](bound.arguments)
                entry["elements"][_dtype(tensors)] += elements
        return real(*args, **kwargs)

    counted.counted_outside = True
    setattr(dist, name, counted)


def install() -> None:
    """Wrap every collective of ``torch.distributed`` this torch has (once per process)."""
    assert "zero_strategy" not in sys.modules, "install() before importing zero_strategy: it binds collectives"
    for name in (*COVERED, *OBJECT_COLLECTIVES):
        if hasattr(dist, name) and not getattr(getattr(dist, name), "counted_outside", False):
            _wrap(name)


def reset() -> None:
    _counts.clear()


@contextlib.contextmanager
def paused():
    """Calls made inside are not counted (a report taken mid-step is no part of the step)."""
    _counting[0] = False
    try:
        yield
    finally:
        _counting[0] = True


def counts() -> dict:
    """``{function: {"calls": n, "elements": {dtype: elements}}}`` since the last :func:`reset`."""
    return {name: {"calls": c["calls"], "elements": dict(c["elements"])} for name, c in _counts.items()}
