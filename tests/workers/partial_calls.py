"""A stage-3 call made on some ranks only must raise within the bound, naming unit and ranks.

One case per launch (a timed-out gloo group is not used again). Rank 0 makes the call
alone ("forward", "state_dict", "generate"), or both ranks generate different lengths
with ``synced_gpus=False`` ("unsynced_generate"), or rank 1 is merely late but within
the bound ("late"). Each rank reports what happened and how long it took.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from _peft_models import tiny_llama
from _worker import start

import zero_strategy as zs


def report(out, payload: dict) -> None:
    """Write this rank's report and leave without another collective (the group may be broken)."""
    rank = dist.get_rank()
    (out / f"rank{rank}.json.tmp").write_text(json.dumps(payload))
    (out / f"rank{rank}.json.tmp").rename(out / f"rank{rank}.json")
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    args, out = start()
    rank, case, bound = dist.get_rank(), args["case"], args["timeout"]
    model, _ = zs.setup(tiny_llama(), None, zs.ZeroConfig(stage=3, param_persistence_threshold=0,
                                                           collective_timeout=bound))
    probe = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(input_ids=probe)  # one call every rank makes
    alone = {
        "forward": lambda: model(input_ids=probe),
        "state_dict": lambda: model.state_dict(),
        "generate": lambda: model.generate(input_ids=probe, max_new_tokens=4, do_sample=False),
    }
    t0 = time.monotonic()
    try:
        with torch.no_grad():
            if case in alone:
                if rank == 0:
                    alone[case]()
                else:
                    time.sleep(bound + 1.5)  # busy elsewhere, never making the call
            elif case == "unsynced_generate":
                model.generate(input_ids=probe, max_new_tokens=2 + 6 * rank, do_sample=False, synced_gpus=False)
                if rank == 0:
                    seconds = time.monotonic() - t0
                    time.sleep(bound + 1.5)  # on to other work (alive: its store serves the ledger)
                    report(out, dict(error=None, seconds=seconds))
            elif case == "late":
                if rank == 1:
                    time.sleep(bound / 2)
                out_ = model(input_ids=probe).logits
                report(out, dict(error=None, seconds=time.monotonic() - t0, logits_sum=out_.sum().item()))
        report(out, dict(error=None, seconds=time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 - reported to the test
        report(out, dict(error=type(e).__name__, message=str(e), seconds=time.monotonic() - t0))


if __name__ == "__main__":
    main()
