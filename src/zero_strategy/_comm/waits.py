"""Waiting for a collective, bounded: :class:`Handle` and the gloo wait thread.

[Note: bounded waits]
At stage 3 every forward, ``state_dict()`` and ``gathered_parameters`` all-gathers, so
a call made on some ranks only (``if rank == 0: model.generate(...)``, a rank-0-only
``save_pretrained``) leaves the ranks that made it waiting for the process group's
timeout: 30 minutes by default, with no word of why. ``Collectives(wait_timeout=s)``
bounds every wait, of every collective issued here (gathers, reduce-scatters, the
loss-scale and gradient-norm all-reduces, broadcasts, and the object collectives,
which are built on tensor collectives for that reason): ``work.wait(timeout)`` raises
after ``s`` seconds (gloo abandons the operation; the group should not be used
again), and :class:`CollectiveTimeout` goes up. A peer that exits or is killed closes
its connections and ends the wait at once with :class:`CollectiveError`. Either
message names the collective (what it was for, its sequence number, the step), the
ranks that never began it or reported a failure, and the last collectives of each
rank: See [Note: naming the rank that failed] in _comm/faults.py. Counting calls costs one
store round trip per call (a forward, a ``state_dict()``), not per collective.

[Note: desync while waiting]
A desync of collectives of different sizes, or of counts, hangs instead. A gloo wait
that has not finished within :data:`DESYNC_CHECK_AFTER` seconds publishes this rank's
flight recorder and compares it with the ones the other ranks published: when a rank
issued a different collective under the same sequence number, every waiting rank
raises :class:`CollectiveDesync` within seconds, naming both collectives (their labels
are unit and group names), instead of waiting ``collective_timeout``. A rank that is
only slow publishes nothing that differs, and the wait goes on to the bound.
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .faults import CollectiveDesync, FlightRecorder, Record

#: seconds a gloo wait runs before it looks for a desync; See [Note: desync while waiting]
DESYNC_CHECK_AFTER = 2.0


@dataclass(frozen=True)
class WaitPolicy:
    """How a group's collectives are waited on, built once by the issuing ``Collectives`` and
    shared by every handle it makes (handles are made per collective: one reference each, not
    five fields and two bound methods). ``timeout``: seconds a wait may take (None: unbounded);
    ``bound``: the same as the timedelta torch's ``wait`` takes; ``gloo``: the works are gloo's
    (waited on a thread where needed); ``failure(record, error)``: the error to raise for a failed
    wait; ``check_desync()``: may raise while a gloo wait runs (See [Note: desync while waiting]).
    Callables, so this module never imports ``collectives`` back."""

    timeout: float | None
    bound: datetime.timedelta | None
    gloo: bool
    failure: Callable[[Record | None, BaseException], BaseException]
    check_desync: Callable[[], None]


class Handle:
    """An in-flight collective. ``wait()`` is idempotent and keeps tensors alive until then."""

    __slots__ = ("_work", "_keep", "_record", "_unbounded", "_policy")

    def __init__(self, work=None, keep: tuple = (), record: Record | None = None, unbounded: bool = False,
                 policy: WaitPolicy | None = None):
        """``unbounded``: the work's own ``wait(timeout)`` ignores the timeout; See [Note: unbounded works].
        ``policy``: how to wait (None: an unbounded ``work.wait()``)."""
        self._work = work
        self._keep = keep
        self._record = record
        self._unbounded = unbounded
        self._policy = policy

    def wait(self) -> None:
        """Wait for the collective; past the engine's bound, or when a peer is gone, raise
        :class:`CollectiveTimeout` / :class:`CollectiveError` (see [Note: bounded waits])."""
        if self._work is not None:
            work, self._work = self._work, None  # a failed operation is abandoned: never waited on again
            policy = self._policy
            try:
                if policy is None or policy.timeout is None:
                    work.wait()
                elif policy.gloo and (self._unbounded or not work.is_completed()):
                    _wait_on_thread(work, policy.timeout, policy.check_desync)
                else:
                    work.wait(policy.bound)
            except CollectiveDesync:
                self._keep = ()
                raise
            except RuntimeError as e:
                self._keep = ()
                if policy is None:
                    raise
                raise policy.failure(self._record, e) from e
            FlightRecorder.finish(self._record, ok=True)
        self._keep = ()


class Then:
    """A handle whose ``wait()`` waits for ``inner`` and then runs ``after`` once (the copies out
    of a coalesced collective; see [Note: coalesced collectives] in _comm/collectives.py)."""

    __slots__ = ("_inner", "_after")

    def __init__(self, inner, after):
        self._inner, self._after = inner, after

    def wait(self) -> None:
        if self._after is not None:
            after, self._after = self._after, None
            self._inner.wait()  # raises before anything is copied out of a failed collective
            after()


def _wait_on_thread(work, seconds: float, check_desync=None) -> None:
    """``work.wait()`` on a daemon thread, given up after ``seconds``; after
    :data:`DESYNC_CHECK_AFTER` seconds ``check_desync()`` runs every second and may raise
    (See [Note: desync while waiting]).

    [Note: unbounded works]
    gloo's reduce-scatter (both the list form and ``reduce_scatter_tensor``, torch 2.13)
    returns a wrapper work whose ``wait(timeout)`` waits on the inner operation without
    the timeout, and whose ``is_completed()`` stays False, so neither a bounded wait nor
    polling can give up on it. The wait runs on a daemon thread instead, which this rank
    waits for with a bound; a thread left blocked by a failed collective dies with the
    process (daemon threads are not joined at exit). One thread per wait costs ~0.1 ms,
    small beside a gloo reduce-scatter.
    """
    done = threading.Event()
    box: list[BaseException] = []

    def run():
        try:
            work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box.append(e)
        done.set()

    threading.Thread(target=run, name="zero_strategy_wait", daemon=True).start()
    deadline = time.monotonic() + seconds
    step = min(seconds, DESYNC_CHECK_AFTER)
    while not done.wait(step):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"Operation timed out after {seconds:g} s")
        if check_desync is not None:
            check_desync()
        step = min(left, 1.0)
    if box:
        raise box[0]
