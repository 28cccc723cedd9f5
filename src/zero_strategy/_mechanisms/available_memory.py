"""How much memory this process may still take: the host's, and the share a plan may use.

Shared by ``zero_auto``'s preset choice (_zero_auto.py) and the gather-once budget of
generation (_model/generation.py), so both read the host the same way and keep the
same headroom.
"""

from __future__ import annotations

import os
from pathlib import Path

#: the share of available memory a plan leaves free (activations, KV cache, allocator slack)
HEADROOM = 0.25
_GIB = 2**30


def host_available_bytes() -> int:
    """Host memory available to new allocations without swapping (MemAvailable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def human_bytes(nbytes: float) -> str:
    """Bytes for people: GiB with two decimals, or MiB/KiB below a GiB."""
    for unit, scale in (("GiB", _GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale or unit == "KiB":
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
