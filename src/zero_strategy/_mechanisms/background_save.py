"""One save at a time on a thread of its own; what it stages is counted, and its failure is kept.

An asynchronous checkpoint save (checkpoint/_async_save.py) copies what it will write into
host buffers on the caller's thread and hands a job to this object, which runs it on a
thread while training goes on. This object knows nothing of checkpoints: it holds

* the thread of the one pending job (a second ``start`` waits for the first: saves never
  overlap, so their files and their collectives come in one order on every rank);
* the host buffers the job has staged and not yet written (``staging_tensors``, counted by
  ``memory_report`` under "staging"), which the job drops one by one as they reach the disk;
* the job's exception, kept until someone waits (See [Note: no silent background failure]);
* the staging buffer of each checkpoint file a save of this model is writing (its ``O_DIRECT``
  block buffer: See [Note: direct writes] in safetensors_writer.py), synchronous saves' too, while
  the file is open (``hold``/``release``): counted under "staging" as well, but not against
  ``async_save_staging_bytes``, which bounds the copies a save stages, not its writer.

[Note: staging buffers kept]
Copying into freshly allocated host memory ran at ~1 GB/s here (each new page is faulted in and
zeroed by the kernel; pinned memory costs more to allocate), into memory touched before at
~10 GB/s (192 MB: 180 ms against 18 ms, torch 2.13, one CPU thread). The save's staging call is
what training waits for, so a written buffer is kept, by dtype and size, and the next save of
the same model takes it again: from the second save on, staging runs at copy speed. What is kept
is at most the last save's buffers, one copy of the rank's files (or ``async_save_staging_bytes``),
counted by ``memory_report`` under "staging" like the staged ones, and freed with the engine
(``teardown``) or by ``zero_strategy.checkpoint.wait_for_save(model, release_buffers=True)``.

[Note: no silent background failure]
A failed write must reach the user. ``wait()`` (the next save, a load, teardown, the end of a
Lightning fit) raises the job's exception, once. When nobody waited before the interpreter
exits, the exit handler below prints it to stderr and logs it. The thread is not a daemon, so
the interpreter's exit waits for a save still writing (Python joins such threads before
``atexit`` handlers run) instead of cutting it off half-way.
"""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from typing import Callable

import torch

__all__ = ["BackgroundSave", "join_saves_to"]

_log = logging.getLogger("zero_strategy")
_LIVE: "weakref.WeakSet[BackgroundSave]" = weakref.WeakSet()


class BackgroundSave:
    """The pending background save of one model (at most one)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._what = ""
        self._lock = threading.Condition()
        self._staged: list[torch.Tensor] = []
        #: written buffers kept for the next save, by (dtype, numel, pinned): See [Note: staging buffers kept]
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._after_success: list[Callable[[], None]] = []
        #: open file writers' staging buffers (See hold)
        self._writing: list[torch.Tensor] = []
        self._accepting = False
        #: how many bytes are staged now and at most since the last job began (for tests and reports)
        self.staged_bytes = 0
        self.peak_staged_bytes = 0
        #: jobs started since setup
        self.started = 0
        _LIVE.add(self)

    # -------------------------------------------------------------- the job
    def start(self, what: str, job: Callable[["BackgroundSave"], None]) -> None:
        """Run ``job(self)`` on a new thread; ``what`` names it in messages. Waits for (and raises
        the error of) the previous job first."""
        self.wait()
        self._what, self._error = what, None
        self.started += 1
        self._accepting = True  # after_success callbacks, until the job ends
        self.peak_staged_bytes = self.staged_bytes
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"zero_strategy save {what}",
                                        daemon=False)
        self._thread.start()

    def _run(self, job) -> None:
        try:
            job(self)
        except BaseException as err:  # noqa: BLE001 - kept and raised by wait(): see the module docstring
            self._error = err
            with self._lock:
                self._after_success.clear()
                self._accepting = False
        else:
            with self._lock:
                callbacks, self._after_success = self._after_success, []
                self._accepting = False
            for fn in callbacks:
                try:
                    fn()
                except Exception as err:  # noqa: BLE001 - a deferred clean-up never fails a finished save
                    _log.warning("zero_strategy: after the save of %s: %s: %s", self._what, type(err).__name__, err)
        finally:
            self.drop_all()

    def wait(self, raise_error: bool = True) -> BaseException | None:
        """Block until the pending job is done; raise its exception (``raise_error=False``: return it).
        A no-op without one. Each failure is reported once."""
        thread = self._thread
        if thread is None:
            return None
        if thread is not threading.current_thread():
            thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error
        return error

    def after_success(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the job's thread once the pending job succeeds (never if it fails); False
        (and ``fn`` not kept) when no job is running, so the caller runs it now."""
        with self._lock:
            if not self._accepting:
                return False
            self._after_success.append(fn)
            return True

    # -------------------------------------------------------------- staging
    def room_for(self, nbytes: int, limit: int | None) -> None:
        """Block until ``nbytes`` more can be staged within ``limit`` (None: no limit), or nothing is
        staged (a piece is never refused), or the job ended (its error comes from :meth:`wait`)."""
        if limit is None:
            return
        with self._lock:
            self._lock.wait_for(lambda: not self._staged or self.staged_bytes + nbytes <= limit
                                or self._thread is None or not self._thread.is_alive())

    def buffer(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """A host buffer to stage ``numel`` elements into: a written one of this shape if one is kept
        (See [Note: staging buffers kept]), else a new one (``pinned``: page-locked, for GPU copies)."""
        with self._lock:
            kept = self._free.get((dtype, numel, pinned))
            if kept:
                return kept.pop()
        return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def keep_only_used(self) -> None:
        """Free the kept buffers this save did not take (a model whose files changed shape)."""
        with self._lock:
            self._free.clear()

    def release_buffers(self) -> None:
        """Free every kept buffer (call it after :meth:`wait`: a running job's come back when written)."""
        with self._lock:
            self._free.clear()

    def stage(self, t: torch.Tensor) -> None:
        """``t`` (a host buffer of the job) is held until :meth:`drop`: counted by memory reports."""
        with self._lock:
            self._staged.append(t)
            self.staged_bytes += t.untyped_storage().nbytes()
            self.peak_staged_bytes = max(self.peak_staged_bytes, self.staged_bytes)

    def drop(self, t: torch.Tensor) -> None:
        with self._lock:
            for i, s in enumerate(self._staged):
                if s is t:
                    del self._staged[i]
                    self.staged_bytes -= t.untyped_storage().nbytes()
                    self._free.setdefault(_key(t), []).append(t)
                    self._lock.notify_all()
                    return

    def drop_all(self) -> None:
        with self._lock:
            for t in self._staged:
                self._free.setdefault(_key(t), []).append(t)
            self._staged.clear()
            self.staged_bytes = 0
            self._lock.notify_all()

    def hold(self, t: torch.Tensor) -> None:
        """``t``, an open checkpoint writer's staging buffer, is held until :meth:`release`."""
        with self._lock:
            self._writing.append(t)

    def release(self, t: torch.Tensor) -> None:
        with self._lock:
            self._writing = [w for w in self._writing if w is not t]

    def staging_tensors(self) -> list[torch.Tensor]:
        """Every host buffer held: staged and not yet written, kept for the next save, and the
        staging buffers of the files being written."""
        with self._lock:
            return list(self._staged) + [t for kept in self._free.values() for t in kept] + list(self._writing)


def _key(t: torch.Tensor) -> tuple:
    return t.dtype, t.numel(), t.is_pinned()


def join_saves_to(path: str) -> None:
    """Wait for every save of this process still writing to ``path`` (another model's too: a load of a
    checkpoint another model is saving must not read it half-written). Their failures stay with
    their models, raised by their own next wait."""
    for save in list(_LIVE):
        thread = save._thread
        if thread is not None and save._what == path and thread is not threading.current_thread():
            thread.join()


@atexit.register
def _report_unseen_failures() -> None:
    """See [Note: no silent background failure]: a job that failed and was never waited for."""
    for save in list(_LIVE):
        if save._thread is not None and not save._thread.is_alive() and save._error is not None:
            err = save._error
            save._error = None
            message = (f"zero_strategy: the asynchronous checkpoint save of {save._what} FAILED and nobody "
                       f"waited for it before exit: {type(err).__name__}: {err}")
            _log.error(message)
            print(message, file=sys.stderr, flush=True)
