"""Giving freed host memory back to the operating system at the end of each whole-model pass.

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

So at the end of every whole-model pass (each optimizer step; the start and end of a
checkpoint save or load, ``full_state_dict``, a streamed ``save_pretrained``; the end of setup)
the engine asks glibc to return its free pages (``malloc_trim(0)``: it unmaps the free top of
each arena and ``madvise``s free pages inside them, and frees nothing still in use). The same
runs then hold 330-435 MiB, the engine's accounting plus at most its peak working set. In
benchmarks/memory_lifecycle.py (a 143M Llama, W = 0.57 GB, 2 ranks, bf16,
``zero3_offload_nvme``), the per-rank peaks fell from 4.5/3.9 W to 3.2/3.1 W in training, from
4.4/4.0 W to 2.3 W in eval and from 4.4/4.0 W to 2.4/2.1 W in the sharded save. A call costs
20-50 ms on that model, against a 1.6-s CPU step at ``zero3``. It runs once per optimizer step,
not per forward, so gradient accumulation adds nothing.

What it does not do: lower the step's own peak as far as returning every free block at once
would. glibc's ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` environment variables, fixed
at 64 KiB, bring the benchmark's training peak above to 2.3 W, but they slowed each CPU step by
35-70% through the page faults of fresh mappings. A user who wants that trade sets them before
starting Python.

Inside the step, too, when the host does its work: the optimizer steps group after group
(a step batch, or a streamed group chunk by chunk), each leaving behind the fp32 gradient
copies and the optimizer's temporaries it freed, many of them in the step worker's own arena.
Without a release between them the process grew by 40-140 MiB per group through the step, on
top of the gradient shards: on the 748M Llama at ``zero3_offload_nvme`` (2 ranks, bf16) the
step's peak was 0.70-0.94 W above the process's baseline. :func:`release_if_large` releases
after each batch of at least :data:`RELEASE_MIN_BYTES` of master whose step ran in host memory; the
same step's peak is then 0.44-0.48 W, and its time did not rise measurably (6.8-6.9 s against
7.0-8.6 s; 13 groups). At setup, before each unit is materialized from the meta device
(a whole unit in fp32, initialized, sharded and freed, one after another): the load of that
model (``from_pretrained`` + ``setup``) peaked at 0.43-0.48 W, and at 0.20-0.24 W with it. And
after ``zero_grad`` frees the gradient shards, which the step's own
release came too early for: they would otherwise stay in the heap into the next phase
(245 MiB per rank after training on that model).

Where there is no glibc (macOS, musl) this is a no-op. ``ZeroConfig(release_host_memory=False)``
turns it off.

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
from typing import Callable


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


#: the fewest bytes a piece of work inside a pass must have allocated and freed (a step batch's
#: fp32 master, the gradient shards ``zero_grad`` drops, a unit setup materialized, a gathered
#: group) for a release after it: below it, the call would cost more than the leftovers weigh
#: (most of a small model's steps, and most of the test suite's)
RELEASE_MIN_BYTES = 64 * 2**20


def release_if_large(enabled: bool, nbytes: int, on_host: bool = True) -> None:
    """Inside a pass: release what a piece of work of ``nbytes`` (in host memory when ``on_host``)
    freed, before the next one allocates on top of it. See [Note: freed host memory].
    ``enabled``: the config's ``release_host_memory``."""
    if enabled and on_host and nbytes >= RELEASE_MIN_BYTES:
        release_freed_host_memory()


@contextlib.contextmanager
def whole_model_pass(enabled: bool, drop_idle_staging: Callable[[], None] | None = None):
    """Release freed host memory before and after a pass over the whole model (a save, a load,
    a full state dict): before, so the pass does not start on top of what the last one freed;
    after, so what it built and dropped is not held on. ``enabled``: the config's
    ``release_host_memory``. ``drop_idle_staging``: frees the NVMe staging buffers no one holds,
    first (See [Note: staging between passes])."""
    def release():
        if drop_idle_staging is not None:
            drop_idle_staging()
        release_freed_host_memory()
    if enabled:
        release()
    try:
        yield
    finally:
        if enabled:
            release()
