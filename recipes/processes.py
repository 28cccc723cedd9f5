"""What the language-model recipes share about their processes: joining the group, printing once,
reading the process's own memory, leaving.

Shared by recipes/infinity_finetune.py and recipes/long_context_finetune.py (both started by
``torch.distributed.run``).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist


def join(timeout_minutes: int) -> None:
    """Join the launch's process group: nccl with one GPU per rank where CUDA is present, else gloo."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=timeout_minutes))


def log(*parts) -> None:
    """Print on rank 0 only (every rank holds the same figures)."""
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def anon_bytes() -> int:
    """The process's anonymous memory now (``RssAnon`` of /proc/self/status): tensors and the heap,
    not the mapped libraries."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def leave() -> None:
    """Leave the group and exit at once: gloo's teardown can abort a finished run at interpreter exit."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
