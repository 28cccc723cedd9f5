"""What ``zero_strategy.setup`` does per parameter tensor, counted (not timed), and that the
initial weights it broadcasts from rank 0 arrive whole.

args["cases"]: list of {model ("params"|"experts"|"mixed"), n, stage, bucket_bytes (optional)}.
Reports per case: the Python function calls setup made (cProfile's count, builtins included),
the broadcasts it issued, and whether every rank ends with rank 0's initial weights and buffers.
"""

from __future__ import annotations

import cProfile
import pstats

import torch
import torch.distributed as dist
from torch import nn

from _worker import finish, run_cases, start

import zero_strategy as zs
from zero_strategy import api

try:  # imported, as a Hugging Face user has it: setup's transformers paths must cost no more per module
    import transformers  # noqa: F401
except ImportError:
    pass


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.b1, self.w2, self.b2 = (nn.Parameter(torch.randn(1)) for _ in range(4))

    def forward(self, x):
        return (x * self.w1 + self.b1) * self.w2 + self.b2


def build(kind: str, n: int) -> nn.Module:
    """``n`` one-element parameters: one ParameterList, or a ModuleList of n/4 experts (a unit or
    flat groups each); ``mixed`` adds tensors of other dtypes and sizes, and buffers."""
    model = nn.Module()
    if kind == "params":
        model.ps = nn.ParameterList(nn.Parameter(torch.randn(1)) for _ in range(n))
    else:
        model.experts = nn.ModuleList(Expert() for _ in range(n // 4))
    if kind == "mixed":
        model.big = nn.Linear(64, 48)
        model.register_buffer("steps", torch.arange(5) * (dist.get_rank() + 1))
        model.register_buffer("bf16_table", torch.randn(7, 3).to(torch.bfloat16))
    return model


def run_case(case: dict, rank: int) -> dict:
    torch.manual_seed(1 + rank)  # every rank starts from other weights: setup must make them rank 0's
    model = build(case["model"], case["n"])
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters())
    broadcasts = []
    real_broadcast, real_bucket = dist.broadcast, api.SYNC_BUCKET_BYTES

    def counted(tensor, *args, **kwargs):
        broadcasts.append(tensor.numel())
        return real_broadcast(tensor, *args, **kwargs)

    dist.broadcast, api.SYNC_BUCKET_BYTES = counted, case.get("bucket_bytes", real_bucket)
    profile = cProfile.Profile()
    try:
        profile.enable()
        model, zopt = zs.setup(model, opt, {"stage": case["stage"], "collective_timeout": 120})
        profile.disable()
    finally:
        dist.broadcast, api.SYNC_BUCKET_BYTES = real_broadcast, real_bucket
    calls = pstats.Stats(profile).total_calls
    full = zs.full_state_dict(model)
    flat = torch.cat([full[k].double().reshape(-1) for k in sorted(full)])
    first = flat.clone()
    dist.broadcast(first, 0)
    as_rank0 = all(torch.equal(full[k], initial[k]) for k in initial) if rank == 0 else None
    zs.teardown(model, keep_weights=False)
    return dict(case=case, calls=calls, broadcasts=len(broadcasts), same_on_every_rank=bool(torch.equal(flat, first)),
                as_rank0=as_rank0, keys_match=sorted(full) == sorted(initial))


def main() -> None:
    args, out = start()
    rank = dist.get_rank()
    finish(out, {"results": run_cases(args["cases"], lambda case: run_case(case, rank))})


if __name__ == "__main__":
    main()
