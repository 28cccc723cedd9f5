"""A fixed set of worker threads, all started when the set is made.

Why not ``concurrent.futures.ThreadPoolExecutor``: it starts its threads lazily, on the
first ``submit`` that finds none idle, and for the NVMe store that first submit comes
from a forward hook (a stage-3 gather reads its parameter shard), inside the region
``torch.compiler.disable`` marks around every hook. CI once saw ``Thread.start()`` wait
there for 300 s for a thread that never began to run. Whatever the cause (thread
start-up under Dynamo's frame-evaluation shim is the suspect), no thread need be started
on the hot path at all: the store knows how many it wants when it is built, at setup,
outside every hook. Starting them then also makes the count fixed and visible.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref

__all__ = ["WorkerThreads"]


class WorkerThreads:
    """``count`` daemon threads serving ``submit``s in order; ``Future`` results, as an executor's.

    Daemon threads, so a store nobody closed never holds the interpreter at exit; the
    store's finalizer shuts them down (waiting for requests in flight) before its file is
    removed. The threads hold only the request queue, not this object: once it is
    collected they are told to stop, as an executor's threads are.
    """

    def __init__(self, count: int, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=_serve, args=(self._queue,), name=f"{name}_{i}", daemon=True)
                         for i in range(count)]
        for t in self._threads:
            t.start()
        weakref.finalize(self, _stop, self._queue, count)

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: submit after shutdown (the store was closed)")
            self._queue.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        with self._lock:
            first = not self._closed
            self._closed = True
            if first and cancel_futures:
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            if first:
                for _ in self._threads:
                    self._queue.put(None)
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()


def _serve(requests: queue.SimpleQueue) -> None:
    while True:
        item = requests.get()
        if item is None:
            return
        future, fn, args = item
        del item
        if future.set_running_or_notify_cancel():
            try:
                result = fn(*args)
            except BaseException as e:  # the caller's wait re-raises it
                future.set_exception(e)
            else:
                future.set_result(result)
        # drop the request (and the buffers it names) before waiting for the next one
        del future, fn, args


def _stop(requests: queue.SimpleQueue, count: int) -> None:
    for _ in range(count):
        requests.put(None)
