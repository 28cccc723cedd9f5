"""A load refused on 2 ranks, caught, and training goes on: nothing may have changed, on any rank.

Saves one intact 2-rank checkpoint (args["dir"]/intact), then rank 0 damages copies of it:
rank 1's file (only rank 1 reads it at the same world size), the buffers file and the
extra state (read after the shards). For each stage and damage every rank trains a step,
takes a snapshot, tries the load and catches the error, takes another snapshot, and trains
one more step; a reference run does the same two steps without the load.
Reports per case: each rank's message, the entries that changed, and whether the next
step's loss and weights equal the reference's exactly.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import zero_strategy as zs
from _refused_load import build, damaged_copy, differences, snapshot, train_step
from _worker import finish, start

DAMAGES = {"rank1_file": "rank00001-of-00002.safetensors", "buffers": "buffers.safetensors",
           "extra_state": "extra_state.pt"}


def _two_steps(stage: int, load_from: str | None) -> dict:
    rank = dist.get_rank()
    model, opt = build(stage)
    train_step(model, opt, rank, 0)
    out: dict = {}
    if load_from is not None:
        before = snapshot(model, opt)
        try:
            zs.load_checkpoint(load_from, model, opt)
            out["message"] = "loaded"
        except zs.CheckpointError as err:
            out["message"] = str(err)
        out["changed"] = differences(before, snapshot(model, opt))
    out["loss"] = train_step(model, opt, rank, 1)
    out["weights"] = zs.full_state_dict(model, dtype=None)
    zs.teardown(model, keep_weights=False)
    return out


def main() -> None:
    args, out = start()
    root = Path(args["dir"])
    rank = dist.get_rank()
    model, opt = build(2, seed=1)
    for step in (10, 11):  # the checkpoint's state differs from every case's
        train_step(model, opt, rank, step)
    zs.save_checkpoint(root / "intact", model, opt, extra_state={"tensor": torch.ones(2)})
    zs.teardown(model, keep_weights=False)
    if rank == 0:
        for name, file in DAMAGES.items():
            damaged_copy(root / "intact", root / name, file)
    dist.barrier()
    results = {}
    for stage in (2, 3):
        ref = _two_steps(stage, None)
        for name in DAMAGES:
            got = _two_steps(stage, str(root / name))
            same = got["loss"] == ref["loss"] and all(torch.equal(got["weights"][k], v)
                                                      for k, v in ref["weights"].items())
            results[f"z{stage}-{name}"] = {"message": got["message"], "changed": got["changed"],
                                           "trains_on_as_if_never_loaded": same}
        intact = _two_steps(stage, str(root / "intact"))  # the control: an intact load changes the state
        results[f"z{stage}-intact"] = {"message": intact["message"], "changed": intact["changed"]}
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
