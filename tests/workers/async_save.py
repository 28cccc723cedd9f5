"""Asynchronous checkpoint saves on N gloo ranks, against the synchronous save of the same run.

args: ``dir`` (a folder the test owns) and ``cases`` (names, run in this order by one launch):

* ``parity``: two identical runs train 2 steps; one saves synchronously, the other
  asynchronously with its writer held until 2 more steps are trained; reports both runs' losses
  and final weights, whether every file of the two checkpoints is byte for byte equal, and the
  staging bytes ``memory_report`` counted while the writer was held and after it finished.
* ``bounded``: the same save with ``async_save_staging_bytes=4096`` through the config: the
  most bytes ever staged, and whether the files equal the synchronous save's.
* ``next_save_waits``: the writer held for 2.5 s by a timer; the next save returns only after
  the first checkpoint is complete.
* ``teardown_waits``: the same for ``teardown``.
* ``write_error``: rank 1's writer fails with ENOSPC; the next save raises on every rank, the
  previous checkpoint at the path is unchanged, no temporary directory is left, a retry works.
* ``kill``: a synchronous save, a step, an asynchronous save to the same path whose writer is
  held mid-file; the process is SIGKILLed while it is held (the report is written first).
"""

from __future__ import annotations

import errno
import filecmp
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _worker import finish, run_cases, start
from _models import SEQ, VOCAB, TinyLM, loss_fn, param_groups

import zero_strategy as zs
from zero_strategy.checkpoint import _save

GLOBAL = 8
HOLD = 2.5  # seconds the writer is held in the waiting cases (the save itself returns in well under that)


def build(**config):
    torch.manual_seed(1234)
    model = TinyLM(layers=2)
    opt = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))
    return zs.setup(model, opt, zs.ZeroConfig(stage=3, param_persistence_threshold=0, **config))


def train(model, opt, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = GLOBAL // world
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(9000 + step)
        tokens = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g)
        loss = loss_fn(model(tokens[rank * per:(rank + 1) * per]), targets[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def hold_writer(release: threading.Event, on_rank: int | None = None):
    """The writer waits for ``release`` before its first write (on every rank, or ``on_rank`` only)."""
    def hook(item):
        if on_rank is None or dist.get_rank() == on_rank:
            release.wait()
    _save._before_background_write = hook


def weights(model) -> dict:
    return {k: v.clone() for k, v in zs.full_state_dict(model, dtype=None).items()}


def equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def case_parity(root: Path) -> dict:
    model, opt = build()
    train(model, opt, range(2))
    zs.save_checkpoint(root / "sync", model, opt, extra_state={"step": 2, "t": torch.arange(3)})
    sync_losses = train(model, opt, range(2, 4))
    sync_final = weights(model)
    zs.teardown(model)

    model, opt = build()
    train(model, opt, range(2))
    release = threading.Event()
    hold_writer(release)
    staged_before = zs.memory_report(model).by_category["staging"]
    zs.save_checkpoint(root / "async", model, opt, extra_state={"step": 2, "t": torch.arange(3)}, async_save=True)
    returned_before_written = not (root / "async").exists()
    staged_held = zs.memory_report(model).by_category["staging"]
    async_losses = train(model, opt, range(2, 4))  # the writer is still held: training changes the state
    release.set()
    zs.checkpoint.wait_for_save(model)
    _save._before_background_write = None
    staged_kept = zs.memory_report(model).by_category["staging"]  # the buffers kept for the next save
    zs.checkpoint.wait_for_save(model, release_buffers=True)
    staged_after = zs.memory_report(model).by_category["staging"]
    rank_file = root / "sync" / f"rank{dist.get_rank():05d}-of-{dist.get_world_size():05d}.safetensors"
    async_final = weights(model)
    zs.teardown(model)
    dist.barrier()
    return dict(case="parity", returned_before_written=returned_before_written,
                losses_equal=sync_losses == async_losses, weights_equal=equal(sync_final, async_final),
                same_files=same_files(root / "sync", root / "async"), staged_before=staged_before,
                staged_held=staged_held, staged_kept=staged_kept, staged_after=staged_after, rank_file_bytes=rank_file.stat().st_size)


def case_bounded(root: Path) -> dict:
    model, opt = build(async_save=True, async_save_staging_bytes=4096)
    train(model, opt, range(2))
    zs.save_checkpoint(root / "bounded", model, opt, extra_state={"step": 2, "t": torch.arange(3)})
    zs.checkpoint.wait_for_save(model)
    peak = model_engine_peak(model)
    zs.teardown(model)
    dist.barrier()
    return dict(case="bounded", peak_staged=peak, same_files=same_files(root / "sync", root / "bounded"))


def model_engine_peak(model) -> int:
    return zs.api._engine_of(model).background_save.peak_staged_bytes


def _held_for(seconds: float) -> float:
    release = threading.Event()
    hold_writer(release)
    threading.Timer(seconds, release.set).start()
    return time.monotonic()


def case_next_save_waits(root: Path) -> dict:
    model, opt = build(async_save=True)
    train(model, opt, range(1))
    began = _held_for(HOLD)
    zs.save_checkpoint(root / "first", model, opt)
    returned_at = time.monotonic() - began
    _save._before_background_write = None
    zs.save_checkpoint(root / "second", model, opt)  # async too: waits for "first" before anything
    first_complete = (root / "first" / "metadata.json").is_file()
    waited = time.monotonic() - began
    zs.teardown(model)
    dist.barrier()
    return dict(case="next_save_waits", returned_at=returned_at, waited=waited, first_complete=first_complete,
                second_complete=(root / "second" / "metadata.json").is_file())


def case_teardown_waits(root: Path) -> dict:
    model, opt = build(async_save=True)
    train(model, opt, range(1))
    began = _held_for(HOLD)
    zs.save_checkpoint(root / "torn", model, opt)
    returned_at = time.monotonic() - began
    zs.teardown(model)
    waited = time.monotonic() - began
    _save._before_background_write = None
    complete = (root / "torn" / "metadata.json").is_file()
    dist.barrier()
    return dict(case="teardown_waits", returned_at=returned_at, waited=waited, complete=complete)


def case_write_error(root: Path) -> dict:
    path = root / "failing"
    model, opt = build(async_save=True)
    train(model, opt, range(1))
    zs.save_checkpoint(path, model, opt, extra_state={"step": 1})
    zs.checkpoint.wait_for_save(model)
    before = weights(model)
    train(model, opt, range(1, 2))

    def fail(item):
        if dist.get_rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
    _save._before_background_write = fail
    zs.save_checkpoint(path, model, opt, extra_state={"step": 2})  # returns: the failure is on the thread
    _save._before_background_write = None
    train(model, opt, range(2, 3))
    try:
        zs.save_checkpoint(root / "next", model, opt)
        message = None
    except zs.CheckpointError as err:
        message = str(err)
    next_written = (root / "next").exists()
    dist.barrier()  # rank 0's writer removed the directory before its wait returned; the others look after that
    leftovers = sorted(p.name for p in root.iterdir() if p.name.startswith(_save.SAVE_PREFIX))
    check, check_opt = build()
    extra = zs.load_checkpoint(path, check, check_opt)
    intact = equal(weights(check), before)
    zs.teardown(check)
    zs.save_checkpoint(root / "retry", model, opt)  # the error was reported once: saving works again
    zs.checkpoint.wait_for_save(model)
    zs.teardown(model)
    dist.barrier()
    return dict(case="write_error", message=message, next_written=next_written, leftovers=leftovers,
                extra=extra, intact=intact, retry=(root / "retry" / "metadata.json").is_file())


def case_kill(root: Path, report: dict, out: Path) -> dict:
    path = root / "killed"
    model, opt = build()
    train(model, opt, range(1))
    zs.save_checkpoint(path, model, opt, extra_state={"step": 1})
    sd = zs.full_state_dict(model, dtype=None)
    if dist.get_rank() == 0:
        torch.save(sd, root / "killed-step1.pt")
    train(model, opt, range(1, 2))
    writing = threading.Event()
    seen = []

    def hook(item):
        seen.append(item[0])
        if len(seen) == 3:  # the rank file is open and its first piece written: hold it mid-file
            writing.set()
            threading.Event().wait()
    _save._before_background_write = hook
    dist.barrier()
    zs.save_checkpoint(path, model, opt, extra_state={"step": 2}, async_save=True)
    train(model, opt, range(2, 3))  # training goes on while the writer is held
    dist.barrier()
    writing.wait(60)
    report["results"].append(dict(case="kill", writing=writing.is_set()))
    finish_report(out, report)
    os.kill(os.getpid(), signal.SIGKILL)


def finish_report(out: Path, report: dict) -> None:
    import json
    rank = dist.get_rank()
    (out / f"rank{rank}.json.tmp").write_text(json.dumps(report))
    (out / f"rank{rank}.json.tmp").rename(out / f"rank{rank}.json")


CASES = {"parity": case_parity, "bounded": case_bounded, "next_save_waits": case_next_save_waits,
         "teardown_waits": case_teardown_waits, "write_error": case_write_error}


def main() -> None:
    args, out = start()
    root = Path(args["dir"])
    report: dict = {"results": []}
    if args["cases"] == ["kill"]:
        case_kill(root, report, out)
    report["results"] = run_cases(args["cases"], lambda name: CASES[name](root))
    finish(out, report)


if __name__ == "__main__":
    main()
