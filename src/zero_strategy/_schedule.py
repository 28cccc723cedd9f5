"""The gather schedule: stage-3 all-gathers in one order that every rank agrees on.

[Note: gather schedule]
At stage 3 a unit is all-gathered when it is about to run, and every rank of the
group must take part in that all-gather. When ranks run different units (an expert
only one rank's samples reach, an image tower only batches with images need, blocks
after an early exit), the gathers of one rank have no partner on the other, and the
k-th all-gathers of the ranks pair up wrongly: silently when the units have one size,
as a hang otherwise. So gathers follow a *schedule*, the same on every rank:

* the forward pass visits the units in registration order (``model.named_modules``
  order: the order a model of repeated blocks runs them in), the backward pass visits
  the units holding trainable parameters in the reverse order;
* before a unit is gathered, every unit before it in the pass that this rank has not
  gathered in this pass yet is *passed*: gathered and released at once, taking part
  in the gathers the ranks that run it make. At the end of the pass (the end of the
  outermost forward, the end of backward) every unit not reached is passed too;
* prefetch gathers the next ``prefetch`` units of the pass, in pass order.

So every rank issues one gather per unit per pass, in pass order, whatever it runs:
a unit some rank skips costs the ranks that skip it one all-gather (and a moment of
its memory), and a model whose ranks run every unit in order issues exactly the
gathers it issued without a schedule. A unit run again in the same pass (a block
called twice, a module called out of registration order) is gathered again on its
own, outside the schedule, as before: exact when every rank does the same, and caught
by the collective signature (see [Note: the collective signature] in _comm/collectives.py)
when ranks differ. Frozen units are left out of the backward pass: a unit without
trainable parameters needs backward only to pass gradients through, which every
rank of a model does alike (an image tower that is frozen never needs it at all).
"""

from __future__ import annotations

import enum

from ._collectives import Collectives
from ._units import Unit


class Pass(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class GatherSchedule:
    """The order of the stage-3 unit gathers in each pass, and how far this rank got in the current one."""

    def __init__(self, units: list[Unit], prefetch: int):
        """``units``: the non-root units with sharded groups, in registration order."""
        self.prefetch = prefetch
        self._orders = {Pass.FORWARD: list(units),
                        Pass.BACKWARD: [u for u in reversed(units) if any(g.trainable for g in u.groups)]}
        self._positions = {p: {id(u): i for i, u in enumerate(order)} for p, order in self._orders.items()}
        self.current: Pass | None = None
        self._cursor = 0  # positions before it were used or passed in this pass
        self._issued = 0  # positions before it have their gather begun in this pass

    def begin(self, which: Pass) -> None:
        """A pass starts: nothing of it gathered yet."""
        self.current, self._cursor, self._issued = which, 0, 0

    def position(self, unit: Unit) -> int | None:
        """``unit``'s place in the current pass, None when it is not in it (or no pass runs)."""
        return None if self.current is None else self._positions[self.current].get(id(unit))

    def remaining(self) -> int:
        """Units of the current pass not used or passed yet."""
        return 0 if self.current is None else len(self._order()) - self._cursor

    def use(self, unit: Unit, comm: Collectives) -> None:
        """``unit`` is about to run: gather it in schedule order (passing what this rank skipped) and
        prefetch the next ones. The caller waits for ``unit``'s gather."""
        position = self.position(unit)
        if position is None or position < self._cursor:  # out of the pass: on its own, as before
            unit.begin_gather(comm)
            return
        self._pass_until(position, comm)
        self._issue_through(position, comm)
        self._cursor = position + 1
        self._issue_through(min(position + self.prefetch, len(self._order()) - 1), comm)

    def finish(self, comm: Collectives) -> None:
        """The pass ends: pass every unit it did not reach, so every rank has gathered each once."""
        if self.current is not None:
            self._pass_until(len(self._order()), comm)
        self.current = None

    def abandon(self) -> None:
        """An iteration an exception abandoned: no pass runs (gathers in flight are the caller's to wait)."""
        self.current = None

    # ----------------------------------------------------------------- helpers
    def _order(self) -> list[Unit]:
        return self._orders[self.current]

    def _issue_through(self, position: int, comm: Collectives) -> None:
        order = self._order()
        while self._issued <= position:
            order[self._issued].begin_gather(comm)
            self._issued += 1

    def _pass_until(self, position: int, comm: Collectives) -> None:
        """Gather and release at once the units from the cursor up to (not including) ``position``."""
        order = self._order()
        for k in range(self._cursor, position):
            self._issue_through(k, comm)
            skipped = order[k]
            skipped.wait_gather()
            skipped.release()
        self._cursor = max(self._cursor, position)
