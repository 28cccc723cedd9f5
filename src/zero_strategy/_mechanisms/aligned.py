"""Host buffers aligned for ``O_DIRECT``: swap-file I/O and its space reservation share them."""

from __future__ import annotations

import torch

#: the alignment O_DIRECT asks of buffer addresses, sizes and file offsets (a page)
ALIGN = 4096


def aligned_empty(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 host tensor whose data pointer and size are multiples of ALIGN (for O_DIRECT)."""
    nbytes = round_up(max(nbytes, 1))
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    offset = (-raw.data_ptr()) % ALIGN
    return raw[offset:offset + nbytes]


def round_up(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN
