"""One rank misbehaves at step 3 of a plain training loop; the others must leave, saying who and where.

``args``: ``case`` (what rank 1 does at step 3, after its forward), ``engine`` ("zero1",
"zero2", "zero3", or "ddp" for the torch baseline), ``timeout`` (ZeroConfig's
collective_timeout). Cases:

* ``raise``: rank 1 raises; its ``finally: zs.teardown(model)`` (how a user cleans up) runs
  while the exception unwinds and must not start a collective.
* ``sigkill``: rank 1 SIGKILLs itself.
* ``stuck``: rank 1 sleeps for an hour (a hung data loader, a deadlock).
* ``desync``: rank 1 calls ``zs.full_state_dict(model)`` alone (a rank-1-only save): it
  issues collectives the others never issue (DDP: one extra ``all_reduce``).
* ``twice``: rank 1's forward at step 3 runs the first block twice (a recurrence only its
  batch takes); at stage 3 it gathers that unit once more than rank 0 does.
* ``cleared``: rank 1 sets the head's gradients to None between backward and step at step 3
  (the head is a flat group of its own): its step skips the head, rank 0's steps it.

Rank 1 writes the time it misbehaved into ``fail_time``; every rank that leaves its loop
reports the error, its message, and the time it left, then exits.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zero_strategy as zs

STEPS, FAIL_STEP = 6, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x))) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 1)

    def forward(self, x, repeat_first: bool = False):
        if repeat_first:  # a recurrence some batches take: the first block once more
            x = self.blocks[0](x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def report(out, payload: dict) -> None:
    rank = int(os.environ["RANK"])  # the group may be destroyed by now
    (out / f"rank{rank}.json.tmp").write_text(json.dumps(payload))
    (out / f"rank{rank}.json.tmp").rename(out / f"rank{rank}.json")


def misbehave(out, case: str, model) -> None:
    (out / "fail_time").write_text(repr(time.time()))
    if case == "raise":
        raise RuntimeError("injected failure on rank 1 at step 3")
    if case == "sigkill":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if case == "stuck":
        time.sleep(3600)
    if case == "desync":
        if isinstance(model, nn.parallel.DistributedDataParallel):
            dist.all_reduce(torch.zeros(1))  # the baseline's own extra collective
        else:
            zs.full_state_dict(model)


def start() -> tuple[dict, Path]:
    """Join the gloo group with ``args["pg_timeout"]`` seconds, or torch's default (30 minutes) as a
    user's script would (the DDP baseline in benchmarks/fault_bench.py)."""
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    timeout = args.get("pg_timeout")
    dist.init_process_group("gloo", **({"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}))
    return args, out


def main() -> None:
    args, out = start()
    rank, case, engine = dist.get_rank(), args["case"], args["engine"]
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if engine == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        stage = int(engine[-1])
        model, opt = zs.setup(model, opt, zs.ZeroConfig(stage=stage, param_persistence_threshold=0,
                                                         collective_timeout=args["timeout"]))
    gen = torch.Generator().manual_seed(rank)
    try:
        try:
            for step in range(1, STEPS + 1):
                x = torch.randn(8, 16, generator=gen)
                twice = case == "twice" and rank == 1 and step == FAIL_STEP
                if twice:
                    (out / "fail_time").write_text(repr(time.time()))
                loss = model(x, repeat_first=twice).pow(2).mean()
                if rank == 1 and step == FAIL_STEP and case not in ("twice", "cleared"):
                    misbehave(out, case, model)
                loss.backward()
                if case == "cleared" and rank == 1 and step == FAIL_STEP:
                    (out / "fail_time").write_text(repr(time.time()))
                    model.head.weight.grad = model.head.bias.grad = None
                opt.step()
                opt.zero_grad()
        finally:
            if engine != "ddp":
                zs.teardown(model)
    except Exception as e:  # noqa: BLE001 - reported to the test
        report(out, dict(error=type(e).__name__, message=str(e), left=time.time()))
        raise
    report(out, dict(error=None, message="", left=time.time()))


if __name__ == "__main__":
    main()
