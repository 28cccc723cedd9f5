"""Train the TinyLM for a range of steps, optionally loading / saving checkpoints on the way.

Every step uses one fixed global batch of GLOBAL samples; rank r of N takes its
GLOBAL/N slice and the loss is the mean over that slice, so the averaged gradient
(and therefore training) is the same at any world size up to float reassociation.

args["cases"]: list of dicts with
  name, stage, precision, start, end (steps [start, end)), load (checkpoint path),
  save ({"<step>": path}: save after finishing that many steps), sd_out (rank 0
  torch.saves full_state_dict(dtype=None) at the end), crash ("write" | "rename":
  the save of the last entry of ``save`` is killed midway, after the report is written;
  "peer_write": only rank 1 is SIGKILLed midway through writing, rank 0 goes on),
  sd_at_save (rank 0 torch.saves full_state_dict(dtype=None) to "<sd_at_save>-<step>.pt"
  after each save), async_save (ZeroConfig(async_save=...): every save asynchronous).
Reports per case: global losses per step, loss-scaler state after each step, extra state.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist

from _worker import finish, start
from _models import SEQ, VOCAB, TinyLM, loss_fn, param_groups

import zero_strategy as zs

GLOBAL = 8


def global_batch(step: int):
    g = torch.Generator().manual_seed(7000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
    return tokens, targets


def build(case: dict):
    torch.manual_seed(1234)
    model = TinyLM(layers=2)
    opt = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))
    cfg = zs.ZeroConfig(stage=case["stage"], precision=case["precision"], param_persistence_threshold=0,
                        loss_scale=zs.LossScaleConfig(growth_interval=2),
                        shard_group_size=case.get("shard_group_size"), async_save=case.get("async_save", False))
    return zs.setup(model, opt, cfg)


def _arm_crash(kind: str) -> None:
    """Make this process die inside the next save: mid-file, or between the two renames."""
    from zero_strategy.checkpoint import _safetensors_stream, _save

    if kind in ("write", "peer_write"):
        original = _safetensors_stream.StreamWriter.write

        def write(self, name, piece):
            original(self, name, piece)
            self._flush_staged()  # what it staged reaches the file before the crash
            if kind == "peer_write":
                os.kill(os.getpid(), signal.SIGKILL)  # a peer dies while the others go on saving
            os._exit(17)  # a rank killed after part of its file is on disk
        _safetensors_stream.StreamWriter.write = write
    else:
        original_rename = _save._rename

        def rename(src, dst):
            original_rename(src, dst)
            os._exit(18)  # killed after moving the previous checkpoint aside
        _save._rename = rename


def run_case(case: dict, out, report: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, zopt = build(case)
    extra = None
    if case.get("load"):
        extra = zs.load_checkpoint(case["load"], model, zopt)
        if isinstance(extra, dict) and extra.get("next_step") != case["start"]:
            raise AssertionError(f"extra_state {extra} does not match start step {case['start']}")
    saves = {int(k): v for k, v in case.get("save", {}).items()}
    losses, scaler = [], []
    per = GLOBAL // world
    for step in range(case["start"], case["end"]):
        tokens, targets = global_batch(step)
        sl = slice(rank * per, (rank + 1) * per)
        loss = loss_fn(model(tokens[sl]), targets[sl])
        zopt.backward(loss)
        zopt.step()
        zopt.zero_grad()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item() / world)
        scaler.append(zopt.scaler.state_dict())
        done = step + 1
        if done in saves:
            extra_state = {"next_step": done, "rng": torch.arange(3)} if case.get("torch_extra") else \
                {"next_step": done}
            if case.get("crash") and done == max(saves):
                result = dict(name=case["name"], losses=losses, scaler=scaler)
                report["results"].append(result)
                _write_report(out, report)
                dist.barrier()
                if case["crash"] != "peer_write" or rank == 1:
                    _arm_crash(case["crash"])
            zs.save_checkpoint(saves[done], model, zopt, extra_state=extra_state)
            if case.get("sd_at_save"):
                sd_now = zs.full_state_dict(model, dtype=None)
                if rank == 0:
                    torch.save(sd_now, f"{case['sd_at_save']}-{done}.pt")
    zs.checkpoint.wait_for_save(model)  # async_save: the case's checkpoints are complete when it ends
    full = zs.full_state_dict(model, dtype=None)
    if case.get("sd_out") and rank == 0:
        torch.save(full, case["sd_out"])
    return dict(name=case["name"], losses=losses, scaler=scaler, skipped=zopt.skipped_steps,
                extra=extra if not isinstance(extra, dict) or "rng" not in extra else
                {**extra, "rng": extra["rng"].tolist()})


def _write_report(out, report: dict) -> None:
    import json

    rank = dist.get_rank()
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(report))
    tmp.rename(out / f"rank{rank}.json")


def main() -> None:
    args, out = start()
    report: dict = {"results": []}
    for case in args["cases"]:
        try:
            report["results"].append(run_case(case, out, report))
        except Exception:  # report, and stop: the other ranks may be waiting in a collective
            report["results"].append(dict(name=case.get("name"), error=traceback.format_exc()))
            print(traceback.format_exc(), file=sys.stderr)
            break
    finish(out, report)


if __name__ == "__main__":
    main()
