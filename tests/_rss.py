"""The process's own measure of its memory, from /proc/self/status (Linux).

``VmRSS``/``VmHWM``: resident set and its peak (tests/test_consolidate_memory.py);
``RssAnon``: its anonymous part, the heap and mmap'd memory tensors live in, without
the mapped files (shared libraries, the interpreter) that imports add. :func:`measured`:
one call's peak of both beside the engine's gathered bytes (the streamed-save workers).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def status_bytes(field: str) -> int:
    """``field`` of /proc/self/status (reported in kB) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def anon_rss() -> int:
    return status_bytes("RssAnon")


def return_freed_memory_to_the_os(threshold: int = 1 << 16) -> None:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own mmap, and
    unmap it when freed, so that anonymous RSS follows what is held.

    By default glibc raises its mmap threshold to the size of each mmap'd block that is
    freed (up to 32 MiB), after which blocks that size come from the heap and, freed, stay
    resident: RSS would then keep a model's freed parameters. Setting the threshold
    explicitly turns that adjustment off (mallopt(3)).
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    if not (libc.mallopt(M_MMAP_THRESHOLD, threshold) and libc.mallopt(M_TRIM_THRESHOLD, threshold)):
        raise OSError("mallopt failed")


def trim_heap() -> None:
    """Give the free pages of glibc's heap back to the OS (``malloc_trim(0)``), so that a baseline
    taken after it does not count memory the next allocations would reuse unseen."""
    ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)


def measured(model, call):
    """Run ``call()`` on a set-up ``model``; return its result and what it took: the peak of
    gathered bytes (the engine's working-set accounting) above those held before, those still
    held after, and the peak resident memory (VmHWM) above the RSS before."""
    import zero_strategy as zs

    gc.collect()
    zs.memory_report(model, reset_peak=True)
    before = zs.memory_report(model).working_set["gathered"]
    rss = status_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
    except OSError:
        pass  # then VmHWM covers more than the call: a looser, still valid upper bound
    result = call()
    peak_rss = status_bytes("VmHWM") - rss
    report = zs.memory_report(model)
    return result, {"gathered": report.peak_working_set["gathered"] - before, "rss": peak_rss,
                    "gathered_after": report.working_set["gathered"] - before}
