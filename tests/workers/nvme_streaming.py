"""Two ranks of tests/test_nvme_streaming_ranks.py: a streamed NVMe run against the same run
with whole-group staging and against DDP, and the process's anonymous memory in training.

Run as ``python nvme_streaming.py OUT_DIR``; args.json holds ``{"cases": [...], "path": ...}``.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _worker import finish, run_cases, start, worst_rel_diff
from _models import TinyLM, batch, loss_fn, param_groups

import zero_strategy as zs


def _anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _nvme(path, tag, buffer):
    return {"device": "nvme", "path": f"{path}/{tag}{dist.get_rank()}", "buffer_size": buffer}


def _train(model, opt, steps=3):
    for step in steps if not isinstance(steps, int) else range(steps):
        tokens, targets = batch(dist.get_rank(), step, 0)
        loss_fn(model(tokens), targets).backward()
        opt.step()
        opt.zero_grad()


def parity(case, path):
    """Streamed (64 KiB slots: the root group is 36 of them) vs whole-group slots vs DDP."""
    torch.manual_seed(0)
    plain = TinyLM(layers=2, dim=48, vocab=2048)
    runs = {}
    for tag, buffer in (("streamed", 64 * 1024), ("whole", 64 * 2**20)):
        nv = _nvme(path, tag, buffer)
        model = copy.deepcopy(plain)
        model, opt = zs.setup(model, torch.optim.AdamW(param_groups(model)),
                              zs.ZeroConfig(stage=3, precision=case["precision"], param_persistence_threshold=0,
                                            offload_optimizer=nv, offload_params=nv))
        streams = [g.masters.streams for g in zs.api._engine_of(model).trainable_groups]
        _train(model, opt)
        runs[tag] = (zs.full_state_dict(model), streams)
        zs.teardown(model, keep_weights=False)
    ref = DDP(copy.deepcopy(plain))
    _train(ref, torch.optim.AdamW(param_groups(ref.module)))
    streamed, whole = runs["streamed"][0], runs["whole"][0]
    exact = all(torch.equal(streamed[k], whole[k]) for k in whole)
    ddp_diff, worst = worst_rel_diff(streamed, ref.module.state_dict())
    return {"case": case, "streamed_groups": sum(runs["streamed"][1]), "whole_groups_streamed": sum(runs["whole"][1]),
            "exact": exact, "ddp_rel_diff": ddp_diff, "worst": worst}


def memory(case, path):
    """Peak anonymous RSS above the level after setup through three steps, sampled every 2 ms,
    beside what the bound is made of (See tests/test_nvme_streaming_ranks.py)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))  # freed blocks go back to the OS (tests/_rss.py)
    libc.mallopt(-3, 1 << 16)
    libc.mallopt(-1, 1 << 16)
    torch.manual_seed(0)
    model = TinyLM(layers=2, dim=256, vocab=16384)  # the root group (tied embedding and head): 4.2M elements
    nv = _nvme(path, "rss", case["buffer"])
    model, opt = zs.setup(model, torch.optim.AdamW(param_groups(model)),
                          zs.ZeroConfig(stage=3, param_persistence_threshold=0, offload_optimizer=nv,
                                        offload_params=nv))
    before = zs.memory_report(model)
    dist.barrier()
    base = _anon()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.002):
            peak[0] = max(peak[0], _anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _train(model, opt)
    stop.set()
    sampler.join()
    after = zs.memory_report(model)
    engine = zs.api._engine_of(model)
    resting = ((after.total - after.by_category["staging"]) - (before.total - before.by_category["staging"]))
    res = {"case": case, "growth": max(peak[0], _anon()) - base, "resting_growth": resting,
           "largest_unit_fp32": 4 * max(sum(g.padded_numel for g in u.groups) for u in engine.units),
           "largest_group_state": 12 * max(g.shard_numel for g in engine.trainable_groups),
           "slots": engine.swap.pool.count, "buffer_size": nv["buffer_size"],
           "staging": after.by_category["staging"], "kept": after.kept_bytes}
    ckpt = Path(path) / "rss-ckpt"
    zs.save_checkpoint(ckpt, model, opt)
    zs.teardown(model, keep_weights=False)
    del model, opt
    res["resume_growth"] = _resume_growth(ckpt, _nvme(path, "rss-resume", case["buffer"]))
    return res


def _resume_growth(ckpt, nv) -> int:
    """Peak anonymous RSS above the level after setup while ``load_checkpoint`` resumes the run."""
    torch.manual_seed(1)
    model = TinyLM(layers=2, dim=256, vocab=16384)
    model, opt = zs.setup(model, torch.optim.AdamW(param_groups(model)),
                          zs.ZeroConfig(stage=3, param_persistence_threshold=0, offload_optimizer=nv,
                                        offload_params=nv))
    dist.barrier()
    base = _anon()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.002):
            peak[0] = max(peak[0], _anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    zs.load_checkpoint(ckpt, model, opt)
    stop.set()
    sampler.join()
    growth = max(peak[0], _anon()) - base
    zs.teardown(model, keep_weights=False)
    return growth


def main():
    args, out = start()
    torch.set_num_threads(1)
    results = run_cases(args["cases"], lambda c: (parity if c["kind"] == "parity" else memory)(c, args["path"]))
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
