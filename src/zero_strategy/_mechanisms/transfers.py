"""Work off the compute thread: pinned host buffers, copies on side streams, the pipelined CPU step, its threads.

What the engine hands off so the compute stream and the main thread go on: host/device copies
(:class:`Transfers`, the staging ring, step batches) and the :class:`WorkerThreads` that run the
CPU step here and the swap file's I/O (_mechanisms/swap_file.py), all started at setup.

[Note: what lives where with offload_optimizer="cpu"]
Per flat group: the fp32 master shard and the optimizer state in (pinned) host
memory, a host copy of the reduced gradient shard in its own dtype (``host_grad``,
cast to fp32 a step batch at a time: See [Note: host gradients in place] in
_engine/storage.py), and the
optimizer step on the CPU with the user's own optimizer (torch's fused CPU AdamW
when it was built with ``fused=True``). The compute device keeps the parameters
(stages 1-2: whole; stage 3: the shard) and the reduced gradient shard. With
``offload_params="cpu"`` (stage 3) the compute-dtype parameter shard rests in
pinned host memory too and is uploaded just in time for each gather.

[Note: the offloaded step overlaps in three places]
1. Backward: each time a unit's reduce-scatter finishes, its accumulated gradient
   shard starts downloading to ``host_grad`` on the D2H stream while backward goes
   on. (A later micro-batch's reduce downloads again and overwrites it; stage 1,
   which reduces at the step, downloads there.)
2. The step: groups are stepped one by one on the CPU by a worker thread; the main
   thread uploads group i's new parameters (H2D stream) and all-gathers them
   (stages 1-2) while the worker steps group i+1.
3. Stage 3 parameter offload: the upload of a unit's parameter shard is part of its
   gather, so prefetching a unit prefetches its upload.
The step itself cannot start during backward: clipping needs the global norm and
fp16 needs the global overflow check, both known only once every gradient is in,
and without an explicit accumulation boundary a later micro-batch may still add to
the gradients. Norms and the overflow check are computed on the device shards (fast)
and applied on the host as one scale factor per group.

On a machine without CUDA the same code runs: host buffers are not pinned, copies
are synchronous, and "events" are already complete; the CPU tests exercise it.

**A fixed set of worker threads**, all started when the set is made.

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
import contextlib
import queue
import threading
import weakref
from dataclasses import dataclass

import torch

from .cast_scratch import CastScratch
from .memory import HostPool, WorkingSet


HOST = torch.device("cpu")

#: the largest pinned staging slot of a cast upload (2 slots); a larger tensor goes in pieces
STAGING_SLOT_BYTES = 64 * 2**20
#: slots of that ring (the estimate's working set counts them: _estimate_working_set.py)
STAGING_SLOTS = 2


@dataclass(frozen=True)
class _Done:
    """A completed transfer (CPU-only machines, or nothing was copied)."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None


DONE = _Done()


class Transfers:
    """Host<->device copies: on dedicated CUDA streams when the device is a GPU.

    Every method returns an event-like object: ``synchronize()`` blocks the host
    until the copy is done, ``wait(stream)`` orders a stream after it.
    """

    def __init__(self, device: torch.device, pin_memory: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = pin_memory and self.cuda
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None
        self._pool: WorkerThreads | None = None
        #: what the engine holds beyond its resting state, now and at its peak (See [Note: the working set])
        self.working_set = WorkingSet()
        self._staging = _StagingRing(STAGING_SLOTS, self.host_empty, self.working_set)
        #: host buffers the step casts gradients into (See [Note: the step's casts reuse their buffers])
        self.cast_scratch = CastScratch()
        #: the training cycle's host buffers, kept for the next step (See [Note: the training cycle's host buffers])
        self.host_pool = HostPool()

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=self.pin)

    def download(self, dst_host: torch.Tensor, src_dev: torch.Tensor):
        """dst_host <- src_dev (any dtypes), after the work queued so far on the current stream."""
        if not self.cuda:
            dst_host.copy_(src_dev)
            return DONE
        current = torch.cuda.current_stream(self.device)
        self.d2h_stream.wait_stream(current)
        with torch.cuda.stream(self.d2h_stream):
            dst_host.copy_(src_dev, non_blocking=True)
            src_dev.record_stream(self.d2h_stream)
            event = torch.cuda.Event()
            event.record(self.d2h_stream)
        return _CudaEvent(event)

    def upload(self, dst_dev: torch.Tensor, src_host: torch.Tensor):
        """dst_dev <- src_host; the caller orders its stream after the returned event."""
        if not self.cuda:
            dst_dev.copy_(src_host)
            return DONE
        self.h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d_stream):
            dst_dev.copy_(src_host, non_blocking=True)
            dst_dev.record_stream(self.h2d_stream)
            event = torch.cuda.Event()
            event.record(self.h2d_stream)
        return _CudaEvent(event)

    def upload_cast(self, dst_dev: torch.Tensor, src_host: torch.Tensor):
        """dst_dev <- src_host cast to dst's dtype on the CPU, through a pinned staging slot.

        Casting on the host halves the bytes over PCIe for bf16/fp16 parameters. Any
        thread may call it: a slot is taken from the ring and handed back with its
        upload's event, so no two copies ever share a slot (see _StagingRing). A tensor
        larger than a slot (``STAGING_SLOT_BYTES``) goes in pieces, so the ring stays
        two slots of at most that size, whatever the largest group.
        """
        piece = max(1, STAGING_SLOT_BYTES // dst_dev.element_size())
        events = []
        for a in range(0, src_host.numel(), piece):
            with self._staging.slot(min(piece, src_host.numel() - a), dst_dev.dtype) as (view, done):
                view.copy_(src_host[a:a + piece])
                done.append(self.upload(dst_dev[a:a + piece], view))
            events.append(done[0])
        return events[-1] if events else DONE  # one stream: the last upload completes after the others

    def staging_tensors(self) -> list[torch.Tensor]:
        return self._staging.buffers()

    @property
    def kept_bytes(self) -> int:
        """Host bytes kept for the next step: the step's cast buffers and the training cycle's
        idle buffers (See [Note: the training cycle's host buffers] in memory.py)."""
        return self.cast_scratch.nbytes + self.host_pool.idle_bytes

    @property
    def pool(self) -> WorkerThreads:
        """One worker: CPU optimizer steps run there, in order, while the main thread uploads.
        Made (its thread started) by the first caller: the offloaded step, at setup."""
        if self._pool is None:
            self._pool = WorkerThreads(1, "zero-cpu-step")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class _StagingRing:
    """A fixed number of pinned staging buffers, safe by construction for any number of threads.

    ``slot()`` blocks until a buffer is free *and* the upload that last read it has
    finished, yields a view of the requested size, and gives the buffer back with the
    new upload's event. Bounded host memory: one buffer per slot, grown to the largest
    request seen.
    """

    def __init__(self, count: int, allocate, working_set: WorkingSet | None = None):
        self._allocate = allocate
        self._working_set = working_set
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._all: list[list] = []
        for _ in range(count):
            entry = [None, DONE]  # [buffer, event of the upload that last read it]
            self._all.append(entry)
            self._free.put(entry)

    @contextlib.contextmanager
    def slot(self, numel: int, dtype: torch.dtype):
        entry = self._free.get()  # blocks while every slot is in use
        done: list = []
        try:
            entry[1].synchronize()
            buf = entry[0]
            if buf is None or buf.numel() < numel or buf.dtype != dtype:
                old = 0 if buf is None else buf.numel() * buf.element_size()
                entry[0] = buf = None
                buf = entry[0] = self._allocate(numel, dtype)
                if self._working_set is not None:
                    self._working_set.replace("staging", old, buf.numel() * buf.element_size())
            yield buf[:numel], done
        finally:
            entry[1] = done[0] if done else DONE
            self._free.put(entry)

    def buffers(self) -> list[torch.Tensor]:
        return [e[0] for e in self._all if e[0] is not None]


class _CudaEvent:
    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def synchronize(self) -> None:
        self.event.synchronize()

    def wait(self, stream=None) -> None:
        (stream or torch.cuda.current_stream()).wait_event(self.event)


#: the fewest master elements one CPU optimizer call steps (see [Note: step batches])
STEP_BATCH_NUMEL = 1 << 23


def step_batches(groups: list, early: dict, limit: int | None = None, size=lambda g: g.master.numel()):
    """Split ``groups`` (in order) into the batches the CPU worker steps in one call each
    (``limit`` and ``size``: the device step's batches, bounded by what they cast instead).

    [Note: step batches]
    One optimizer call has a fixed cost (Python dispatch over every param group, the
    kernel launch, a worker hand-off: ~0.1-0.3 ms) that 16 small groups pay 16 times;
    on a 1M-parameter model that was most of the step. Consecutive groups are stepped
    together until a batch holds ``STEP_BATCH_NUMEL`` elements (8M: ~0.3 ms of Adam on
    two cores, so the fixed cost stays under a few percent while a large model still
    pipelines its uploads and all-gathers with the next batch's step). A group that
    already stepped during backward (overlap_step) is its own batch, and a master that
    cannot step beside others (``steps_together`` false: NVMe, whose host slots are
    few) steps alone. Yields ``(batch, groups after it)``.
    """
    limit = STEP_BATCH_NUMEL if limit is None else limit
    batch: list = []
    total = 0
    for i, g in enumerate(groups):
        alone = id(g) in early or not g.masters.steps_together
        if batch and (alone or total >= limit):
            yield batch, groups[i:]
            batch, total = [], 0
        batch.append(g)
        total += size(g)
        if alone:
            yield batch, groups[i + 1:]
            batch, total = [], 0
    if batch:
        yield batch, []


#: the most gradient elements one device-step batch casts to fp32 (64 MiB of copies)
DEVICE_CAST_BATCH_NUMEL = 1 << 24


def device_step_batches(groups: list) -> list[list]:
    """The device step's batches: consecutive groups until their fp32 gradient copies reach
    :data:`DEVICE_CAST_BATCH_NUMEL`; one batch when the gradients are fp32 already. See [Note:
    fp32 gradients only for the groups being stepped] in _engine/storage.py."""
    return [batch for batch, _ in step_batches(groups, {}, limit=DEVICE_CAST_BATCH_NUMEL,
                                               size=lambda g: g.master_grad_cast_numel)]


# ------------------------------------------------------------ worker threads
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
