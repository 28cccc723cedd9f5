"""Build a model that was created on the meta device, one unit at a time.

[Note: why unit by unit]
A model too big for one rank is created with ``torch.device("meta")`` (shapes, no
storage). ``setup`` materializes it unit by unit: allocate the unit's parameters on
the compute device, initialize them, make every rank agree with rank 0 (one
broadcast per tensor), copy them into the unit's flat buffers and, for stage 3,
release all but this rank's shard, before touching the next unit. Peak memory is
the sharded model plus one unit, never the whole model.

Parameters keep their Python identity (``torch.utils.swap_tensors``), so optimizers
built over the meta parameters, tied weights and the user's references stay valid, and
their class and attributes (``swap_tensors`` swaps those too, so they are put back: a
bitsandbytes ``Params4bit`` keeps its ``quant_state``).

Initialization: ``param_init_fn(module)`` is called for every module whose own
parameters live in the unit; by default that is ``module.reset_parameters()``.
A meta parameter that nothing initializes is an error that names it: silent
garbage weights are worse than a crash. Buffers created on the meta device are
allocated too and must be (re)computed by ``param_init_fn`` (for example rotary
embedding frequencies), since their constructor's values were never stored.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from .._comm.collectives import Collectives


def default_init(module: nn.Module) -> bool:
    """``module.reset_parameters()`` if it has one; returns whether it initialized anything."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
        return True
    return False


@torch.no_grad()
def materialize_unit(
    modules: Iterable[nn.Module],
    params: list[nn.Parameter],
    device: torch.device,
    comm: Collectives,
    param_init_fn: Callable[[nn.Module], object] | None,
    names: dict[int, str],
    loaded_later: frozenset[int] = frozenset(),
) -> None:
    """Allocate, initialize and broadcast the meta parameters ``params`` (and the modules' meta buffers).

    ``loaded_later``: ids of parameters whose every element a pending load writes (See [Note:
    weights that arrive at setup]); they are only allocated, never initialized nor broadcast, and
    a module whose own parameters are all such is not initialized: values nobody keeps cost
    time, and each written page is memory beyond the shards (See [Note: why unit by unit])."""
    meta = [p for p in params if p.is_meta]
    if not meta:
        return
    meta_ids = {id(p) for p in meta}
    for p in meta:
        real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
        torch.utils.swap_tensors(p, real)
        if type(real) is not nn.Parameter:  # a subclass (bitsandbytes' Params4bit) keeps its class and state
            p.__class__, p.__dict__ = type(real), real.__dict__
    modules = list(modules)
    new_buffers: set[int] = set()
    for m in modules:
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
                new_buffers.add(id(m._buffers[name]))
    covered: set[int] = set(meta_ids & loaded_later)
    for m in modules:
        own = [p for p in m.parameters(recurse=False) if id(p) in meta_ids]
        if not own and param_init_fn is None:
            continue
        if own and all(id(p) in loaded_later for p in own) and not any(id(b) in new_buffers for b in m.buffers(False)):
            continue
        if param_init_fn is not None:
            param_init_fn(m)
            covered.update(id(p) for p in own)
        elif default_init(m):
            covered.update(id(p) for p in own)
    missing = [names[id(p)] for p in meta if id(p) not in covered]
    if missing:
        raise ValueError(
            f"zero_strategy.setup: meta-device parameters {missing[:5]}{' ...' if len(missing) > 5 else ''} "
            "belong to modules without reset_parameters(), so nothing would initialize them; pass "
            "param_init_fn=fn (called as fn(module) for each module; e.g. a Hugging Face model's "
            "_init_weights) to setup")
    for m in modules:  # every rank starts from rank 0's values, as for a materialized model
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            if id(t) not in loaded_later:
                comm.broadcast(t.data, src_rank=0, label="initial weights")


def unit_modules(root: nn.Module, unit_module: nn.Module, unit_roots: set[int]) -> list[nn.Module]:
    """The modules of one unit's subtree, without the subtrees of other units inside it
    (``unit_roots``: id of every unit's module)."""
    out, stack = [], [unit_module]
    while stack:
        m = stack.pop()
        if id(m) in unit_roots and m is not unit_module:
            continue
        out.append(m)
        stack.extend(m.children())
    return out
