"""What every worker does first and last: join the gloo group, report, exit cleanly."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def start() -> tuple[dict, Path]:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    if int(os.environ["WORLD_SIZE"]) > 1 or args.get("always_init", True):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    return args, out


def finish(out: Path, report: dict) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(out / f"rank{rank}.json")
    import gc
    gc.collect()  # set-up models collected: their NVMe swap files are removed before os._exit
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
