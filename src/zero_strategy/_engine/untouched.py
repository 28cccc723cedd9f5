"""Parameters no rank has a gradient for, inside a flat group that is stepped.

[Note: no gradient on any rank]
DDP with ``find_unused_parameters=True`` leaves ``.grad`` None on a parameter that no
rank used in the step, and torch's optimizers skip such a parameter: it keeps its
value and its state (no weight decay, no momentum). A parameter some ranks used gets
the mean with zeros from the others. The engine computes the same, in three parts:

1. The step agreement (:class:`GradientAgreement` over ``Collectives.begin_agreement``,
   one small all-reduce per optimizer step that also compares the collective
   checksums) tells every rank, per parameter, whether any rank has a gradient for it
   since the last ``zero_grad``. A parameter some rank has one for gets a
   ``param.grad`` marker on every rank, as DDP gives it the mean of the others'.
2. A flat group no rank has a gradient for is not stepped: its master gets no
   ``.grad`` and the user's optimizer skips it, exactly as DDP's parameters. A group
   some rank has one for is reduced on every rank, zeros where a rank has none, so
   the collectives stay in lock-step. Experts and other members of module lists get
   groups of their own for this (See [Note: members get their own flat groups] in
   _engine/units.py), which makes an unused expert exact, Adam's step count included.
3. Inside a group that is stepped, the parameters no rank has a gradient for
   (*untouched*: a projector on a text-only step, an unused head) keep their master
   values and their elementwise optimizer state (:func:`keep_untouched`): the group's
   zero gradient would otherwise move them through weight decay and momentum. What a
   flat group cannot keep apart is state shared by the whole group (Adam's ``step``
   count, which sets the bias correction): it counts the group's steps, where DDP's
   parameter counts its own. Put such a module in a list or dict of one class, or
   in its own unit, to make it exact.

[Note: the agreement at the end of backward]
At stages 2-3 the agreement runs at the end of every synced backward, where DDP
all-reduces its map of the parameters each rank used: it starts once the last
reduce-scatters are issued, so its latency hides behind theirs, and the step that
follows needs no collective of its own (``GradBuffer.agreed``; a new backward, a
``zero_grad`` or the step itself ends it). What it decides is what DDP decides there:
after backward a parameter another rank used has a ``.grad`` here too, and
``model.zero_grad()`` reaches the reduced gradient this rank holds for it (it did not
before: an expert only the other rank's samples reached kept its gradient, and the
next step added onto it). Stage 1 reduces in the step, and agrees there. Gradients
cleared between backward and step are then cleared on this rank without asking the
others, as every rank runs the same code: the step skips a group cleared whole, as
torch skips parameters without ``.grad``. Clearing it on some ranks only is folded into
the collective checksums (``Collectives.note_local``), so the next agreement raises
:class:`CollectiveDesync` instead of letting the ranks step different parameters.

With ``ZeroConfig(overlap_step=True)`` a group is stepped as soon as its gradients are
reduced, before the agreement; a parameter of it no rank used is then stepped with a
zero gradient (documented in docs/how-it-works.md, "Ranks that use different parameters").
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterable, Iterator

import torch



class GradientAgreement:
    """The step agreement over ``groups`` (part 1 of the Note), from start to decision.

    Started where every rank has issued the collectives it covers: at the end of a synced
    backward at stages 2-3 (See [Note: the agreement at the end of backward]), otherwise
    in the step. Carries, per parameter, whether this rank has a gradient for it, and per
    group whether this rank must still reduce it (stage 1: every group once per step;
    stages 2-3: what ``no_sync`` left), plus the collective checksums.
    """

    def __init__(self, comm, groups: list, keep_full: bool, unfrozen: list[str]):
        """``unfrozen``: this rank's parameters frozen at setup that have a gradient now."""
        self.groups, self.keep_full, self.unfrozen = groups, keep_full, unfrozen
        received = [r for g in groups for r in g.grads.received_slots]
        needs = [g.grads.has_unreduced or (keep_full and g.grads.grad_shard is None) for g in groups]
        self._received = len(received)
        self._pending = comm.begin_agreement(torch.tensor(received + needs + [bool(unfrozen)]))

    def decide(self, in_backward: bool) -> tuple[list, bool]:
        """Wait, then act on what the ranks agreed: a group no rank has a gradient for is cleared
        (part 2); the others learn their untouched slots (part 3), and every parameter some rank
        has a gradient for carries a ``param.grad`` marker here too, as DDP gives a parameter
        another rank used a ``.grad`` (so that ``model.zero_grad()`` reaches its reduced
        gradient). Returns the groups every rank must reduce now, in order, and whether some
        rank has gradients for parameters frozen at setup (the caller refuses the step).
        ``in_backward``: decided at the end of the backward that brought the gradients."""
        agreed = self._pending.result().tolist()
        to_reduce, at = [], 0
        for g, any_needs in zip(self.groups, agreed[self._received:-1]):
            anyone, at = agreed[at:at + len(g.slots)], at + len(g.slots)
            if not any(anyone):  # not stepped, as DDP's parameters without a gradient
                g.zero_grad(keep_full=self.keep_full)
                continue
            g.grads.untouched = frozenset(s.index for s, a in zip(g.slots, anyone) if not a)
            g.grads.mark_received([s for s, a in zip(g.slots, anyone) if a], in_backward)
            if any_needs:
                to_reduce.append(g)
        return to_reduce, bool(agreed[-1])


class StepAgreements:
    """Where the step agreement runs for one engine, and what the step takes from it: at the end
    of a synced backward at stages 2-3, else in the step (See [Note: the agreement at the end of
    backward])."""

    def __init__(self, comm, keep_full: bool):
        self.comm, self.keep_full = comm, keep_full
        self._unfrozen = False  # what the last backward's agreement said of unfrozen parameters

    def begin(self, groups: list, unfrozen_names) -> GradientAgreement:
        """End of a synced backward, once its last reduce-scatters are issued: start, do not wait.
        ``unfrozen_names()``: this rank's parameters frozen at setup that have a gradient now."""
        return GradientAgreement(self.comm, groups, self.keep_full, unfrozen_names())

    def decide_in_backward(self, agreement: GradientAgreement) -> None:
        """End of backward, its reduce-scatters waited: the step that follows needs no agreement."""
        _, self._unfrozen = agreement.decide(in_backward=True)
        for g in agreement.groups:
            g.grads.agreed = True

    def for_step(self, groups: list, unfrozen_names) -> list:
        """The step of ``groups``: apply the user's clearings since the last backward, agree unless
        that backward did, refuse unfrozen parameters; returns the groups to reduce now."""
        agreed = all(g.grads.agreed for g in groups)  # by the last backward: the same on every rank
        for g in groups:  # model.zero_grad() & co. since then: See [Note: param.grad after backward]
            if g.grads.take_cleared_slots(keep_full=self.keep_full) and agreed:
                self.comm.note_local("gradients cleared after backward", g.name)
        if agreed:
            to_reduce, unfrozen = [], self._unfrozen
        else:
            to_reduce, unfrozen = GradientAgreement(self.comm, groups, self.keep_full,
                                                    unfrozen_names()).decide(in_backward=False)
        if unfrozen:  # requires_grad_(True) after setup: See [Note: conversions on a set-up model]
            raise unfrozen_error(unfrozen_names())
        for g in groups:
            g.grads.agreed = False  # used by this step
        return to_reduce


#: state torch's elementwise optimizers start from something other than zeros: key -> the
#: param-group setting it starts from (Adagrad's accumulator, Rprop's step sizes)
_INITIAL_FROM_GROUP = {"sum": "initial_accumulator_value", "step_size": "lr"}


@contextlib.contextmanager
def keep_untouched(optimizer: torch.optim.Optimizer, groups: Iterable, window: tuple[int, int] | None = None
                   ) -> Iterator[None]:
    """Around one optimizer step of ``groups``: afterwards, put back the master elements and
    the optimizer state (of the master's shape) of their untouched parameters.

    State the step creates (the group's first step) is set back to the optimizer's initial
    value on those elements: a zero gradient plus weight decay (SGD, Adam with
    ``weight_decay``) would have written ``wd * p`` into it. A parameter kept behind while
    a step count shared by its group advanced, and then used again, is warned about once
    per group (the one difference from DDP that is left). ``untouched`` is used once:
    the next step's agreement sets it again.

    ``window=(a, b)``: the one group is stepped a chunk at a time (a streamed NVMe group,
    _optim/chunked_step.py) and its master and state are now elements [a, b) of the shard;
    ``untouched`` is used up by the chunk that ends the shard.
    """
    saved, fresh, kept = [], [], []
    with torch.no_grad():
        for g in groups:
            master = g.master
            if master is None or master.grad is None:  # not stepped now
                continue
            untouched = g.grads.untouched
            if window is None or window[1] >= g.shard_numel:
                g.grads.untouched = frozenset()
                _warn_if_back(g, untouched)
            if not untouched:
                continue
            if window is None or window[1] >= g.shard_numel:
                kept.append((g, untouched))
            where = [w for s, _, _, w in g.slot_ranges_in_shard() if s.index in untouched]
            if window is not None:
                where = _within(where, *window)
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


def stepped_whole(g) -> None:
    """Group ``g`` was stepped, with no untouched parameter, by a step that does not go through
    :func:`keep_untouched` (the windowed Adam step of _optim/adam_windows.py, which steps only such
    groups): what that would have done for it, the warning for parameters used again after being
    kept behind, and ``untouched`` used up."""
    untouched, g.grads.untouched = g.grads.untouched, frozenset()
    _warn_if_back(g, untouched)


def _within(where: list[slice], a: int, b: int) -> list[slice]:
    """The parts of shard ranges ``where`` inside elements [a, b), relative to ``a``."""
    out = []
    for w in where:
        lo, hi = max(w.start, a), min(w.stop, b)
        if lo < hi:
            out.append(slice(lo - a, hi - a))
    return out


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
        "with the other modules of its class, or outside the blocks. See 'Ranks that use different "
        "parameters' in the how-it-works guide (docs/how-it-works.md).", stacklevel=2)


def unfrozen_names(groups: list) -> list[str]:
    """Parameters frozen at setup that have a gradient now (``requires_grad_(True)`` after setup: See
    [Note: conversions on a set-up model] in _model/conversions.py)."""
    return [s.fqn for g in groups if not g.trainable for s in g.slots
            if s.param.requires_grad and s.param.grad is not None]


def unfrozen_error(names: list[str]) -> RuntimeError:
    """Raised on every rank once the step agreement says some rank has such gradients."""
    which = (f"{names[:4]}{' and more' if len(names) > 4 else ''}" if names
             else "parameters of this model (on another rank)")
    return RuntimeError(
        f"zero_strategy: {which} got gradients but were frozen (requires_grad=False, or in no optimizer) "
        "when the model was set up, so the engine holds no gradient shard, fp32 master or optimizer state "
        "for them and the step would leave them untrained. Unfreeze before zero_strategy.setup / "
        "accelerator.prepare / Trainer.fit (gradual unfreezing: give them requires_grad=True and a param "
        "group with lr=0 until their turn), or call zero_strategy.teardown(model) and set the model up again.")
