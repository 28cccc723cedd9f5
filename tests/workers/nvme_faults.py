"""One rank's disk fails under NVMe offload; every rank must end with an error, none may hang.

args: ``paths`` (one swap base per rank), ``fail_rank``, ``fault``:
  "reserve": this rank's swap estimate is 0, so its first step grows the file on a disk
             that is really full (a small tmpfs);
  "enospc":  every pwrite from step ``at`` on raises ENOSPC (a filesystem whose
             fallocate does not guarantee space: CoW, thin provisioning, quota);
``steps``. Reports the error type and message each rank saw and when.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from _worker import start
from _models import TinyLM, batch, loss_fn, param_groups

import zero_strategy as zs
import zero_strategy._mechanisms.swap_file as swap_file
import zero_strategy._engine.placement as placement


def config(path):
    nv = {"device": "nvme", "path": path, "buffer_size": 16384}
    return zs.ZeroConfig(stage=3, param_persistence_threshold=0, offload_optimizer=nv, offload_params=nv)


def main() -> None:
    args, out = start()
    rank = dist.get_rank()
    failing = rank == args["fail_rank"]
    if failing and args["fault"] == "reserve":
        placement.swap_bytes = lambda *a, **k: 0
    report = {"rank": rank, "steps_done": 0}
    t0 = time.monotonic()
    try:
        torch.manual_seed(0)
        model = TinyLM(layers=2)
        model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), config(args["paths"][rank]))
        for step in range(args["steps"]):
            if failing and args["fault"] == "enospc" and step == args["at"]:
                def full(*a, **k):
                    raise OSError(errno.ENOSPC, "No space left on device")
                swap_file.os.pwrite = full
            t0 = time.monotonic()
            tokens, targets = batch(rank, step, 0)
            loss_fn(model(tokens), targets).backward()
            zopt.step()
            zopt.zero_grad()
            report["steps_done"] = step + 1
    except Exception as err:  # noqa: BLE001 - the report is the test's evidence
        report.update(type=type(err).__name__, error=str(err), seconds=time.monotonic() - t0)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    if "error" not in report:
        dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
