"""One swap set of the NVMe store: the tensors of a flat group swapped together, and where
their values are (See [Note: residency] in _mechanisms/nvme.py)."""

from __future__ import annotations

import enum
import threading

import torch


class Residency(enum.Enum):
    """Where a swap set's values are. See [Note: residency]."""

    OWN_MEMORY = "own memory"  # just registered: adopt() writes it out, then evicts it
    EVICTED = "evicted"        # only in the swap file; the tensors' .data are empty
    READING = "reading"        # a slot is taken and its read is in flight (prefetch)
    IN_SLOT = "in slot"        # the tensors view the slot (from swap_in to swap_out)


class SwapSet:
    """Tensors of one group swapped together ("opt": master + optimizer state; "param")."""

    def __init__(self, name: str):
        self.name = name
        self.tensors: dict[str, torch.Tensor] = {}
        self.slot: torch.Tensor | None = None
        self.reads: list = []
        self.residency = Residency.OWN_MEMORY
        #: keys whose .data currently views the slot (tensors adopted while resident do not)
        self.in_slot: set[str] = set()
        #: keys of tensors that are not 1-D (an owned parameter's state): their shapes in the slot
        self.shapes: dict[str, torch.Size] = {}
        #: (tensor, key, where, shape): views of a swapped tensor that follow its residency
        self.aliases: list[tuple[torch.Tensor, str, slice, torch.Size]] = []
        self.lock = threading.Lock()

    def point_aliases(self) -> None:
        """Point the aliases at their tensor while it is resident (or in its own memory), else empty."""
        resident = self.residency in (Residency.IN_SLOT, Residency.OWN_MEMORY)
        for t, key, where, shape in self.aliases:
            t.data = self.tensors[key].data[where].view(shape) if resident else torch.empty(0, dtype=t.dtype)
