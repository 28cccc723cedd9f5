"""What a rank knows when a collective fails: its flight recorder and the other ranks' progress.

[Note: naming the rank that failed]
A collective that does not complete tells the waiting rank nothing about *why*: gloo
reports "Connection closed by peer" (a process exited or was killed) or a timeout
(a rank is stuck, slow, or on another code path). Three records, all kept per engine
under one namespace in the c10d store the process group rendezvoused through, turn
that into a sentence that names a rank:

* **progress**: each rank counts the calls that start its collectives (forwards,
  ``state_dict`` calls, ...; :meth:`Ledger.enter`). The store answers without the other
  ranks' help, so the rank stuck in a collective reads how far the others got: a rank
  whose count is below ours never began the call we are stuck in.
* **failure reports**: a rank that gives up (its own collective failed, or it tears
  down while an exception unwinds) writes one line saying why
  (:meth:`Ledger.report_failure`); the survivors quote it.
* **flight recorders**: each rank keeps the last :data:`FLIGHT_RECORDS` collectives it
  issued (op, what it was for, bytes, its sequence number, the step, when it started
  and whether it completed) in a ring buffer (:class:`FlightRecorder`). A rank that
  gives up prints its own and publishes it in the store, and quotes every record
  another rank published. This is torch's NCCL flight recorder idea
  (``TORCH_NCCL_TRACE_BUFFER_SIZE``: a ring of the last collectives, dumped on a
  watchdog timeout) on every backend, at Python cost: one ``deque.append`` per
  collective; the store is touched once per call (``enter``), never per collective.

The store's host may be the rank that died (rank 0 without torchrun's agent store):
every store access degrades to "unknown" instead of raising.
"""

from __future__ import annotations

import collections
import json
import sys
import time
import zlib
from dataclasses import asdict, dataclass

import torch.distributed as dist

#: collectives each rank remembers for the dump on failure
FLIGHT_RECORDS = 16
#: of those, how many the error message shows per rank
SHOWN_RECORDS = 6
#: seconds a failing rank waits for the other ranks' flight recorders (they fail within moments)
GRACE = 3.0
#: the stream of every collective except the stage-3 gradient reduce-scatters
MAIN = "main"


class CollectiveError(RuntimeError):
    """A collective this rank took part in failed: a peer exited, was killed, or went away.

    The message names the collective (what it was for, its sequence number, the step),
    the ranks that never began it or reported a failure, and the last collectives of
    this rank (and of the others that published theirs); see [Note: naming the rank that
    failed]. The process group should not be used after it.
    """


class CollectiveTimeout(CollectiveError):
    """A collective this rank waited on did not complete within ``ZeroConfig(collective_timeout)``:
    a peer is stuck, much slower, or issued different collectives (a desync)."""


class CollectiveDesync(CollectiveError):
    """The ranks issued different collectives: a module used on some ranks only, in an order the
    engine cannot make agree (see [Note: the collective signature] in _comm/collectives.py). The
    message names the first collective that differs on each side."""


@dataclass
class Record:
    """One collective as this rank issued it."""

    seq: int
    op: str
    label: str
    numel: int
    nbytes: int
    step: int
    started: float  # time.time(), comparable across the ranks of a host
    state: str = "issued"  # issued -> completed | failed
    seconds: float | None = None
    #: which sequence of collectives: See [Note: two streams of collectives] in _comm/collectives.py
    stream: str = MAIN

    def line(self) -> str:
        took = "" if self.seconds is None else f" in {self.seconds:.3g} s"
        what = f" {self.label!r}" if self.label else ""
        return (f"#{self.number} step {self.step} {self.op}{what} {_size(self.nbytes)} "
                f"{self.state}{took} (t={self.started:.3f})")

    @property
    def number(self) -> str:
        """The sequence number as messages show it: ``5`` on the main stream, ``grads:5`` on another."""
        return str(self.seq) if self.stream == MAIN else f"{self.stream}:{self.seq}"


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


class FlightRecorder:
    """A ring buffer of the last collectives this rank issued; see [Note: naming the rank that failed]."""

    def __init__(self, size: int = FLIGHT_RECORDS):
        self.records: collections.deque[Record] = collections.deque(maxlen=size)
        self.seqs: dict[str, int] = {MAIN: 0}  # collectives issued so far, per stream
        #: per stream, a checksum of every collective issued since the last :meth:`take_signatures`
        self.signatures: dict[str, int] = {MAIN: 0}
        self.step = 1  # the optimizer step the next collectives belong to, counted from 1
        #: the latest local decision folded into the signature (kept apart: the ring may drop it)
        self.last_local: Record | None = None

    def issue(self, op: str, label: str, numel: int, nbytes: int, stream: str = MAIN) -> Record:
        seq = self.seqs[stream] = self.seqs.get(stream, 0) + 1
        # See [Note: the collective signature] in _comm/collectives.py
        self.signatures[stream] = zlib.crc32(f"{op}|{label}|{numel}".encode(), self.signatures.get(stream, 0))
        record = Record(seq, op, label, numel, nbytes, self.step, time.time(), stream=stream)
        self.records.append(record)
        if op.startswith(LOCAL):
            self.last_local = record
        return record

    def take_signatures(self, streams: tuple[str, ...]) -> list[int]:
        """The checksums of ``streams`` since the last call, each restarted."""
        out = [self.signatures.get(s, 0) for s in streams]
        self.signatures = {s: 0 for s in self.signatures}
        return out

    @staticmethod
    def finish(record: Record | None, ok: bool) -> None:
        if record is not None:
            record.state = "completed" if ok else "failed"
            record.seconds = time.time() - record.started

    def dump(self) -> list[dict]:
        return [asdict(r) for r in self.records]


class Ledger:
    """Per-engine progress, failure reports and published flight recorders in the c10d store."""

    def __init__(self, group_ranks: tuple[int, ...], rank: int, namespace: str):
        """``namespace``: the same on every rank of the group, and new for every engine."""
        self.rank = rank
        self.group_ranks = group_ranks
        self.world_size = len(group_ranks)
        self.count = 0
        self.last_kind = ""
        self._prefix = f"zero_strategy/{'-'.join(map(str, group_ranks))}/{namespace}/"
        self._store = _default_store()

    # ---------------------------------------------------------------- writing
    def enter(self, kind: str) -> None:
        """This rank begins a call that issues collectives (``kind``: "forward", "state_dict", ...)."""
        self.count += 1
        self.last_kind = kind
        self._try(lambda s: s.add(self._key("entries", self.rank), 1))

    def publish_flight(self, recorder: FlightRecorder) -> None:
        """Publish this rank's flight recorder, first thing when it gives up: the other ranks wait a
        moment for it (:data:`GRACE`) while they write their messages."""
        self._try(lambda s: s.set(self._key("flight", self.rank), json.dumps(recorder.dump())))

    def report_failure(self, why: str, recorder: FlightRecorder) -> None:
        """Say why this rank gives up, for the other ranks' messages."""
        self.publish_flight(recorder)
        self._try(lambda s: s.set(self._key("failed", self.rank), why[:2000]))

    # ---------------------------------------------------------------- reading
    def counts(self) -> list[int] | None:
        """Every rank's count now (``add(key, 0)`` reads without waiting); None without a store."""
        return self._try(lambda s: [int(s.add(self._key("entries", r), 0)) for r in range(self.world_size)])

    def published(self, what: str, grace: float = 0.0) -> dict[int, str]:
        """Group rank -> what it published under ``what`` ("failed", "flight"), waiting up to ``grace``
        seconds for every other rank (ranks that hit the same bound publish within moments)."""
        def read(s):
            out: dict[int, str] = {}
            deadline = time.monotonic() + grace
            while True:
                for r in range(self.world_size):
                    key = self._key(what, r)
                    if r != self.rank and r not in out and s.check([key]):
                        out[r] = s.get(key).decode(errors="replace")
                if len(out) == self.world_size - 1 or time.monotonic() >= deadline:
                    return out
                time.sleep(0.05)
        return self._try(read) or {}

    def flights(self, grace: float = 0.0) -> dict[int, list[Record]]:
        """Group rank -> the flight records it published (waiting up to ``grace`` s for them)."""
        out: dict[int, list[Record]] = {}
        for r, text in self.published("flight", grace=grace).items():
            try:
                out[r] = [Record(**d) for d in json.loads(text)]
            except (ValueError, TypeError):
                continue
        return out

    def describe(self) -> str:
        """Which ranks did not begin the call this rank is in, for an error message."""
        counts = self.counts()
        here = f"this rank (group rank {self.rank}) is in its call #{self.count} ({self.last_kind or 'gather'})"
        if counts is None:
            return here + "; how far the other ranks got is unknown (the c10d store is gone)"
        behind = [r for r, c in enumerate(counts) if c < self.count]
        ahead = [r for r, c in enumerate(counts) if c > self.count]
        parts = [here]
        if behind:
            parts.append("group ranks " + ", ".join(f"{r} (at call #{counts[r]})" for r in behind)
                         + " never began it")
        if ahead:
            parts.append("group ranks " + ", ".join(f"{r} (at call #{counts[r]})" for r in ahead)
                         + " are already past it")
        if not behind and not ahead:
            parts.append("every rank began it, so a rank is stuck, slow or dead inside it")
        return "; ".join(parts)

    # ---------------------------------------------------------------- helpers
    def _key(self, what: str, rank: int) -> str:
        return f"{self._prefix}{what}/{rank}"

    def _try(self, fn):
        if self._store is None:
            return None
        try:
            return fn(self._store)
        except Exception:  # noqa: BLE001 - the store's host may be the rank that died
            self._store = None
            return None


def _default_store():
    """The store the default process group rendezvoused through (None if unavailable)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private accessor: degrade to messages without rank names
        return None


def is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def diagnosis(ledger: Ledger | None, recorder: FlightRecorder, record: Record | None, rank: int,
              waited: float | None, error: BaseException) -> str:
    """The error message for a collective that failed on this rank; see [Note: naming the rank that failed]."""
    what = "a collective" if record is None else (
        f"collective #{record.number} ({record.op}{f' of {record.label!r}' if record.label else ''}, step {record.step})")
    if is_timeout(error):
        how = f"waited {waited:g} s for {what}, which did not complete"
    else:
        how = (f"lost {what}: a peer closed its connection or failed (it exited, was killed, or raised)")
    lines = [f"zero_strategy: rank {rank} {how}."]
    flights: dict[int, list[Record]] = {}
    if ledger is not None:
        lines.append("Progress: " + ledger.describe() + ".")
        grace = min(GRACE, waited or GRACE) if is_timeout(error) else GRACE / 3  # a dead peer sends nothing
        flights = ledger.flights(grace)
        reports = ledger.published("failed")
        for r, why in sorted(reports.items()):
            lines.append(f"Group rank {r} reported: {why}")
        silent = [r for r in range(ledger.world_size) if r != rank and r not in reports and r not in flights]
        if silent:
            lines.append(f"Group ranks {', '.join(map(str, silent))} reported nothing: stuck outside this "
                         "engine's collectives (a hang, a long rank-only task) or dead (killed, out of memory).")
        lines += [find_desync(recorder, r, theirs) for r, theirs in sorted(flights.items())
                  if find_desync(recorder, r, theirs)]
    lines += _flight_lines(recorder, rank, flights)
    lines.append(f"({type(error).__name__}: {str(error).strip()[:500]})")
    return "\n".join(lines)


def _flight_lines(recorder: FlightRecorder, rank: int, flights: dict[int, list[Record]]) -> list[str]:
    lines = [f"Last collectives of group rank {rank} (oldest first):"]
    lines += ["  " + r.line() for r in list(recorder.records)[-SHOWN_RECORDS:]]
    for r, theirs in sorted(flights.items()):
        lines.append(f"Last collectives of group rank {r} (published when it gave up):")
        lines += ["  " + x.line() for x in theirs[-SHOWN_RECORDS:]]
    return lines


def desync_diagnosis(ledger: Ledger | None, recorder: FlightRecorder, rank: int,
                     flights: dict[int, list[Record]], when: str) -> str:
    """The message of a :class:`CollectiveDesync` detected ``when`` ("while waiting", ...)."""
    found = [f for f in (find_desync(recorder, r, theirs) for r, theirs in sorted(flights.items())) if f]
    local = [r for r in (recorder.last_local,) if r is not None and r.step >= recorder.step - 1]
    head = f"zero_strategy: rank {rank} found that the ranks issued different collectives {when}. "
    if any(LOCAL in f for f in found) or (local and not found):  # else the ranks' decisions agree
        lines = [head + "A decision every rank must take alike was taken on some ranks only"
                 + (f" (this rank: {local[-1].op[len(LOCAL):]} {local[-1].label!r} at step {local[-1].step})"
                    if local else "")
                 + ": clear gradients between backward and step the same way on every rank, or with "
                 "optimizer.zero_grad() after the step. The process group should not be used after this."]
    else:
        lines = [head + "At stage 3 this means a unit (a module subtree gathered as one) was used on some "
                 "ranks only, out of the order in which the units are gathered (for example a block "
                 "called twice on one rank and once on another, or modules called in another order per "
                 "rank). Make every rank call the same units in the same order (run a skipped module on "
                 "zero-sized input, as DDP users do for unused towers), name the module that holds the "
                 "varying part in ZeroConfig(unit_classes=[...]) so it is gathered as one unit, or use "
                 "stage 2. The process group should not be used after this."]
    lines += found or ["The first collective that differs is older than the flight recorders reach (the "
                       "checksums differ)."]
    if ledger is not None:
        lines.append("Progress: " + ledger.describe() + ".")
    lines += _flight_lines(recorder, rank, flights)
    return "\n".join(lines)


#: the op of a record that is no collective: a local decision folded into the signature
LOCAL = "local: "


def find_desync(mine: FlightRecorder, rank: int, theirs: list[Record]) -> str:
    """The first collective number at which ``rank`` issued something else than this rank, if any."""
    ours = {(r.stream, r.seq): r for r in mine.records}
    for other in theirs:
        here = ours.get((other.stream, other.seq))
        if here is not None and (here.op, here.label, here.numel) != (other.op, other.label, other.numel):
            return (f"Desync: collective #{other.number} is {here.op} {here.label!r} ({here.numel} elements, "
                    f"step {here.step}) on this rank but {other.op} {other.label!r} ({other.numel} elements, "
                    f"step {other.step}) on group rank {rank}: the ranks issued different collectives.")
    return ""


def failing_exception() -> BaseException | None:
    """The exception being handled right now (teardown inside an ``except`` block), if any."""
    return sys.exc_info()[1]
