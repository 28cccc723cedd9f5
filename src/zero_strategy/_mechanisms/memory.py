"""Memory beyond the resting states: what a rank holds now, what it keeps for the next step, what it gives back.

One concept in three parts, each the others' context: the :class:`WorkingSet` counts what the
training cycle holds on top of its resting shards (gathered units, gradient buckets, staging);
the :class:`HostPool` keeps the cycle's host buffers warm for the next step instead of freeing
them; :class:`ReleasePoints` hands freed host pages back to the operating system where a
phase ends, and empties the pool there.

**The working set**: what a rank holds beyond its resting shards, now and at its peak.

[Note: the working set]
``memory_report`` counts the tensors that rest (shards, masters, optimizer state); what
makes a process run out of memory is what it holds on top of them at its worst moment:
stage-3 units gathered (the prefetch window), full gradient buffers of units whose
reduce-scatter has not finished (gradient buckets), and staging buffers (NVMe slots,
pinned upload slots, a large group brought whole into memory for a checkpoint). Each of
those places reports its allocations and frees here, under one lock, a few calls per
unit or group per step (never per parameter), so the high-water mark costs nothing on
the hot path. ``reset_peak`` starts a new measurement (a phase: load, train, save).

**Host buffers of the training cycle**, kept by size for the next step instead of freed.

[Note: the training cycle's host buffers]
Every backward allocates the same host buffers again: each group's gradient bucket (the full
unreduced gradients), its reduced gradient shard (held until ``zero_grad``), and at stage 3
each unit's gathered parameters. Allocated with ``torch.empty``, a buffer of a few MiB or more
comes from glibc as fresh pages (its own ``mmap``, or heap that glibc's free trimmed back to
the OS), so the first write into it faults every page in and the kernel zeroes it: on the
48M-parameter model of benchmarks/hot_path.py at ``zero2_offload``, the copies of autograd's
gradients into fresh buckets ran at 2 GB/s where a warm copy runs at 10, and backward took
2.2x a plain model's. So these buffers come from this pool and go back to it: a freed one is
kept under its exact size and dtype, and the next request of that size (the same group next
step, or another unit of the same shape) takes it warm. Only buffers nothing else refers to
are kept: one a view still shares (a ``param.grad`` a user holds, a gradient handed to the
optimizer) is left to be freed as before, so a kept buffer can never change under anyone.

The pool holds what the training cycle holds at its peak, no more: each kept buffer was in use
at once with the others of its kind. ``memory_report(model).kept_bytes`` shows what it keeps
(beside the resting states and the working set: a kept buffer stands where the gradients or
buckets it held stood), and the pool empties where a phase ends (See [Note: releases where a phase ends]
below). GPU memory needs none of this: the CUDA caching allocator keeps blocks itself.

**Giving freed host memory back to the operating system** where a phase ends, never inside the training cycle.

[Note: freed host memory]
The engine frees what it gathers (stage-3 units, full gradients, staging, the copies a save
writes), but what a process holds is what its allocator keeps, not what it has freed. On
Linux, glibc's malloc keeps freed heap memory for later requests, and its *dynamic* mmap
threshold moves every tensor up to 32 MiB to the heap once a tensor of that size has been
freed. Training's pattern is a bad case for this: activations, gathered units and
gradient buckets of many sizes, freed in a different order than taken, in several threads'
arenas. On a 4-layer Llama of 21M parameters in one process, bf16 (tests/test_freed_host_memory.py),
the engine holds 281-361 MiB at rest while the process grew 481-605 MiB by the end of the
first step, and kept it through every later phase (eval, save, state dict) and against the
NVMe offload, whose point is to hold little.

So where a phase ends (See [Note: releases where a phase ends] for each place and why) the
engine asks glibc to return its free pages (``malloc_trim(0)``: it unmaps the free top of each
arena and ``madvise``s free pages inside them, and frees nothing still in use). In
benchmarks/memory_lifecycle.py (a 143M Llama, W = 0.57 GB, 2 ranks, bf16,
``zero3_offload_nvme``), releasing after each step and around each whole-model pass took the
per-rank peaks from 4.4/4.0 W to 2.3 W in eval and to 2.4/2.1 W in the sharded save.

glibc's ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` environment variables, fixed at
64 KiB, return every large block as it is freed; they slowed each CPU step by 35-70% through the
page faults of fresh mappings. A user who wants that trade sets them before starting Python.

Where there is no glibc (macOS, musl) this is a no-op. ``ZeroConfig(release_host_memory=False)``
turns it off.

[Note: releases where a phase ends]
A release is not free: it costs the call (walking every arena, 2-30 ms) and, worse, every page
it returns is faulted in again (and zeroed by the kernel) by whoever allocates it next. Inside
the training cycle (forward, backward, step, ``zero_grad``) that is always the next iteration:
what a step frees (activations, autograd's gradients, the gradient shards ``zero_grad`` drops)
is what the next one allocates, size for size. Released after each step (as from 2026-12-04 to
2026-12-07), the offloaded step ran at 0.43-0.54x torch's fused AdamW on the same tensors
(36M parameters, stage 2; 0.91-0.98x without the release), and a whole iteration of a 21M
Llama at ``zero3_offload`` took 446 ms against 217 ms. So the cycle releases nothing: what it
frees stays in the allocator for the next iteration, and the process holds the training
phase's level while it trains (tests/test_freed_host_memory.py holds that it does not grow
from step to step). What would grow from step to step, the step's fp32 gradient copies,
reuses buffers instead (See [Note: the step's casts reuse their buffers] in cast_scratch.py).

The releases are where what training freed will not be needed again:
- **A forward without autograd after a step** (``torch.no_grad``/``inference_mode``: an
  evaluation, a generation): training has stopped, and its activations and gradients will not
  come back before the next step. Once per such phase: a second no-grad forward releases
  nothing. Not when no-grad forwards are part of the training cycle itself (a reference
  model's logits computed with the policy's own weights, as DPO with PEFT does): if the cycle
  before the last step ran one, the next one is taken for the cycle again.
- **Around a whole-model pass** (a checkpoint save or load, ``full_state_dict``, a streamed
  ``save_pretrained``): before, so the pass does not start on top of what training freed;
  after, so what it built and dropped is not held. And inside such a pass, after each large
  group it gathers or copies (:func:`release_if_large`): the pass is one-off, so nothing
  faults those pages back in on the next step.
- **The end of setup**, and before each unit setup materializes from the meta device (a whole
  unit in fp32, initialized, sharded and freed, one after another): setup happens once. The
  load of the 748M Llama (``from_pretrained`` + ``setup``) peaked at 0.43-0.48 W without it and
  at 0.20-0.24 W with it.
Each release also frees the engine's buffers kept from step to step that no one holds (the
step's cast buffers, the idle NVMe staging slots), so the phase after it starts from the
engine's resting state.

[Note: staging between passes]
The NVMe staging pool keeps its buffers from one step to the next (``buffer_count`` slots of
up to ``buffer_size``, at least ``read_ahead + 4``: 320 MiB by default), so a step does not
allocate and fault them in again. Around a save, a load, a ``full_state_dict`` or a streamed
``save_pretrained`` they are idle weight: the pass uses one or two slots, often smaller
ones. So such a pass frees the slots no one holds, before it starts and again at its end,
and the next step allocates what it uses (on a CPU: allocating and faulting in the default
pool's 320 MiB measured 74-81 ms, once per save, against a step of seconds at that model
size; on a GPU, pinning them again). A read already under way keeps its slot. On the 748M
Llama of benchmarks/memory_lifecycle.py (2 ranks, ``zero3_offload_nvme``) the pool was 0.11 W
of a rank's 0.2 W at rest; the sharded save went from 0.41/0.42 W to 0.20 W per rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import threading
from typing import Callable, Iterator

import torch


#: the working-set categories, in the order reports list them
WORKING_SET_CATEGORIES = ("gathered", "grad_buckets", "staging")


class WorkingSet:
    """Bytes held now per category, each category's peak, and the peak of their sum."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = {k: 0 for k in WORKING_SET_CATEGORIES}
        self.peak = dict(self.current)
        self.peak_total = 0

    def add(self, category: str, nbytes: int) -> None:
        with self._lock:
            now = self.current[category] + nbytes
            self.current[category] = now
            if now > self.peak[category]:
                self.peak[category] = now
            total = sum(self.current.values())
            if total > self.peak_total:
                self.peak_total = total

    def remove(self, category: str, nbytes: int) -> None:
        with self._lock:
            self.current[category] -= nbytes

    def replace(self, category: str, old: int, new: int) -> None:
        """One buffer of ``old`` bytes became one of ``new`` (0: none) bytes."""
        if old:
            self.remove(category, old)
        if new:
            self.add(category, new)

    def reset_peak(self) -> None:
        """The peaks start again from what is held now."""
        with self._lock:
            self.peak = dict(self.current)
            self.peak_total = sum(self.current.values())

    def snapshot(self) -> tuple[dict[str, int], dict[str, int], int]:
        with self._lock:
            return dict(self.current), dict(self.peak), self.peak_total


# ------------------------------------------------ the training cycle's host buffers
def storage_use_count(t: torch.Tensor) -> int | None:
    """How many tensors and storage handles refer to ``t``'s storage (None: torch cannot say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    return count(t.untyped_storage()._cdata) - 1  # less the handle this call made


class HostPool:
    """Host tensors kept by (numel, dtype) for reuse (See [Note: the training cycle's host buffers])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.idle_bytes = 0

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized 1-D tensor: a kept host buffer of that size when there is one."""
        if device.type == "cpu" and numel:
            with self._lock:
                kept = self._idle.get((numel, dtype))
                if kept:
                    buf = kept.pop()
                    self._account(-buf.numel() * buf.element_size())
                    return buf
        return torch.empty(numel, dtype=dtype, device=device)

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.empty(numel, dtype, device).zero_()

    def give_back(self, t: torch.Tensor | None) -> None:
        """``t`` is no longer used by its owner: keep it for the next request of its size, unless
        it is not a whole host buffer or anything else still refers to it."""
        if t is None or t.device.type != "cpu" or t.dim() != 1 or not t.numel():
            return
        if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            return  # a view of a larger buffer
        if storage_use_count(t) != 1:
            return  # shared (or torch cannot tell): left to be freed by its last holder
        with self._lock:
            self._idle.setdefault((t.numel(), t.dtype), []).append(t)
            self._account(t.numel() * t.element_size())

    def release(self) -> None:
        """Free every kept buffer (a phase ended: the next step allocates again)."""
        with self._lock:
            self._idle.clear()
            self._account(-self.idle_bytes)

    def _account(self, delta: int) -> None:
        self.idle_bytes += delta


# -------------------------------------------------------- freed host memory
@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_host_memory() -> bool:
    """Return the allocator's free host pages to the OS; True when the C library could (glibc).

    See [Note: freed host memory]. Safe from any thread and at any time: it only gives back
    memory no live allocation uses."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


#: the fewest bytes a piece of work inside a one-off pass must have allocated and freed (a unit
#: setup materialized, a group a save gathered) for a release after it: below it, the call would
#: cost more than the leftovers weigh (most of the test suite's)
RELEASE_MIN_BYTES = 64 * 2**20


def release_if_large(enabled: bool, nbytes: int, on_host: bool = True) -> None:
    """Inside a one-off pass (setup, a save, a load; never the training cycle): release what a
    piece of work of ``nbytes`` (in host memory when ``on_host``) freed, before the next one
    allocates on top of it. See [Note: releases where a phase ends].
    ``enabled``: the config's ``release_host_memory``."""
    if enabled and on_host and nbytes >= RELEASE_MIN_BYTES:
        release_freed_host_memory()


class ReleasePoints:
    """Where the engine gives freed host memory back: the ends of phases, never inside the
    training cycle (See [Note: releases where a phase ends]).

    ``enabled``: the config's ``release_host_memory``. ``drop_idle``: frees the engine's idle
    buffers first (the NVMe staging slots no one holds, the step's cast buffers)."""

    def __init__(self, enabled: bool, drop_idle: Callable[[], None] | None = None):
        self.enabled = enabled
        self._drop_idle = drop_idle
        self._stepped = False  # an optimizer step since the last release
        self._no_grad_since_step = False
        self._no_grad_in_cycle = False  # the last cycle (step to step) ran a no-grad forward

    def release(self) -> None:
        """A phase ends here: release now."""
        self._stepped = False
        if not self.enabled:
            return
        if self._drop_idle is not None:
            self._drop_idle()
        release_freed_host_memory()

    def on_step(self) -> None:
        """An optimizer step ended: the training cycle goes on (nothing released)."""
        self._stepped = True
        self._no_grad_in_cycle, self._no_grad_since_step = self._no_grad_since_step, False

    def on_no_grad_forward(self) -> None:
        """A forward without autograd begins (eval, generation): the end of training, unless
        such forwards are part of the training cycle itself (a reference model's logits)."""
        if self._stepped and not self._no_grad_in_cycle and not self._no_grad_since_step:
            self.release()
        self._no_grad_since_step = True

    @contextlib.contextmanager
    def around_pass(self) -> Iterator[None]:
        """A pass over the whole model outside training (a save, a load, a full state dict):
        released before, so it does not start on top of what training freed, and after, so what
        it built and dropped is not held on."""
        self.release()
        try:
            yield
        finally:
            self.release()
