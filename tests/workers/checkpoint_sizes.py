"""Save one checkpoint per case and report what its files hold, for the estimate's disk figures.

args["cases"]: dicts with name, preset, precision, optimizer ("adamw" | "sgd_momentum"),
root (a directory to save under). Each case builds a small MLP with one frozen layer, takes one
optimizer step and calls ``zs.save_checkpoint``; rank 0 reports the trainable and frozen
element counts and the tensor bytes the saved safetensors files hold (read from their headers:
the payload, not the files' headers or the metadata).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
import torch.distributed as dist

from _worker import finish, run_cases, start

import zero_strategy as zs


def tensor_bytes(path: Path) -> int:
    """The bytes of tensor data a safetensors file holds: the sum of its header's data offsets."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(end - begin for key, entry in header.items() if key != "__metadata__"
               for begin, end in [entry["data_offsets"]])


def run(case: dict) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(192, 192) for _ in range(5)])
    model[0].requires_grad_(False)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = (torch.optim.AdamW(params, lr=1e-3) if case["optimizer"] == "adamw"
                 else torch.optim.SGD(params, lr=1e-2, momentum=0.9))
    model, optimizer = zs.setup(model, optimizer, {"preset": case["preset"], "precision": case["precision"]})
    dtype = torch.bfloat16 if case["precision"] == "bf16" else torch.float32
    model(torch.randn(4, 192, dtype=dtype)).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    path = Path(case["root"]) / case["name"]
    zs.save_checkpoint(path, model, optimizer)
    dist.barrier()
    files = sorted(p for p in path.iterdir() if p.name.endswith(".safetensors"))
    zs.teardown(model)
    return {"name": case["name"], "trainable": trainable, "frozen": frozen,
            "tensor_bytes": sum(tensor_bytes(p) for p in files), "files": [p.name for p in files]}


if __name__ == "__main__":
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run)})
