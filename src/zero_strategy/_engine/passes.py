"""A pass over the whole model outside training (a save, a load, a full state dict): what the
engine gives back around it. See [Note: freed host memory] and [Note: staging between passes]
in _mechanisms/host_memory.py."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from .._mechanisms import host_memory

if TYPE_CHECKING:
    from .engine import ZeroEngine


@contextlib.contextmanager
def whole_model_pass(engine: "ZeroEngine") -> Iterator[None]:
    """Freed host memory released and idle NVMe staging dropped, before the block and after it
    (``release_host_memory=False``: neither)."""
    drop = engine.swap.pool.drop_idle if engine.swap is not None else None
    with host_memory.whole_model_pass(engine.config.release_host_memory, drop):
        yield
