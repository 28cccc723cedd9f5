"""Parameters no rank has a gradient for, inside a flat group that is stepped.

[Note: no gradient on any rank]
DDP with ``find_unused_parameters=True`` leaves ``.grad`` None on a parameter that no
rank used in the step, and torch's optimizers skip such a parameter: it keeps its
value and its state (no weight decay, no momentum). A parameter some ranks used gets
the mean with zeros from the others. The engine computes the same, in three parts:

1. The step agreement (:func:`agree_on_gradients` over ``Collectives.agree_on_step``,
   one small all-reduce per optimizer step that also compares the collective
   checksums) tells every rank, per parameter, whether any rank has a gradient for it
   since the last ``zero_grad``.
2. A flat group no rank has a gradient for is not stepped: its master gets no
   ``.grad`` and the user's optimizer skips it, exactly as DDP's parameters. A group
   some rank has one for is reduced on every rank, zeros where a rank has none, so
   the collectives stay in lock-step. Experts and other members of module lists get
   groups of their own for this (See [Note: members get their own flat groups] in
   _units.py), which makes an unused expert exact, Adam's step count included.
3. Inside a group that is stepped, the parameters no rank has a gradient for
   (*untouched*: a projector on a text-only step, an unused head) keep their master
   values and their elementwise optimizer state (:func:`keep_untouched`): the group's
   zero gradient would otherwise move them through weight decay and momentum. What a
   flat group cannot keep apart is state shared by the whole group (Adam's ``step``
   count, which sets the bias correction): it counts the group's steps, where DDP's
   parameter counts its own. Put such a module in a list or dict of one class, or
   in its own unit, to make it exact.

With ``ZeroConfig(overlap_step=True)`` a group is stepped as soon as its gradients are
reduced, before the agreement; a parameter of it no rank used is then stepped with a
zero gradient (documented in README, "Ranks that use different parameters").
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterable, Iterator

import torch

from ._conversions import unfrozen_error


def agree_on_gradients(comm, groups: list, keep_full: bool, unfrozen: list[str]) -> list:
    """The step agreement over ``groups`` (part 1 of the Note): per parameter, whether some
    rank has a gradient for it, and per group whether some rank must reduce it (stage 1:
    every group once per step; stages 2-3: what ``no_sync`` left), in one small all-reduce
    that also compares the collective checksums. A group no rank has a gradient for is
    cleared (part 2); the others learn their untouched slots (part 3). Returns the groups
    every rank must reduce now, in order; raises on every rank if some rank has gradients
    for parameters frozen at setup (``unfrozen``: this rank's)."""
    received = [r for g in groups for r in g.grads.received_slots]
    needs = [g.grads.has_unreduced or (keep_full and g.grads.grad_shard is None) for g in groups]
    agreed = comm.agree_on_step(torch.tensor(received + needs + [bool(unfrozen)])).tolist()
    if agreed[-1]:
        raise unfrozen_error(unfrozen)
    to_reduce, at = [], 0
    for g, any_needs in zip(groups, agreed[len(received):-1]):
        anyone, at = agreed[at:at + len(g.slots)], at + len(g.slots)
        if not any(anyone):  # not stepped, as DDP's parameters without a gradient
            g.zero_grad(keep_full=keep_full)
            continue
        g.grads.untouched = frozenset(s.index for s, a in zip(g.slots, anyone) if not a)
        if any_needs:
            to_reduce.append(g)
    return to_reduce


#: state torch's elementwise optimizers start from something other than zeros: key -> the
#: param-group setting it starts from (Adagrad's accumulator, Rprop's step sizes)
_INITIAL_FROM_GROUP = {"sum": "initial_accumulator_value", "step_size": "lr"}


@contextlib.contextmanager
def keep_untouched(optimizer: torch.optim.Optimizer, groups: Iterable) -> Iterator[None]:
    """Around one optimizer step of ``groups``: afterwards, put back the master elements and
    the optimizer state (of the master's shape) of their untouched parameters.

    State the step creates (the group's first step) is set back to the optimizer's initial
    value on those elements: a zero gradient plus weight decay (SGD, Adam with
    ``weight_decay``) would have written ``wd * p`` into it. A parameter kept behind while
    a step count shared by its group advanced, and then used again, is warned about once
    per group (the one difference from DDP that is left). ``untouched`` is used once:
    the next step's agreement sets it again.
    """
    saved, fresh, kept = [], [], []
    with torch.no_grad():
        for g in groups:
            master = g.master
            if master is None or master.grad is None:  # not stepped now
                continue
            untouched, g.grads.untouched = g.grads.untouched, frozenset()
            _warn_if_back(g, untouched)
            if not untouched:
                continue
            kept.append((g, untouched))
            where = [w for s, _, _, w in g.slot_ranges_in_shard() if s.index in untouched]
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
        "with the other modules of its class, or outside the blocks. See README, \"Ranks that use "
        "different parameters\".", stacklevel=2)
