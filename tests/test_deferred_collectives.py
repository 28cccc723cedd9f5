"""A result read before its wait() would be a race on GPUs, or with a worker thread.

Here every asynchronous operation of the engine takes effect only at its wait (see
``deferred_collectives`` in tests/workers/parity.py): async all-gathers and
reduce-scatters (NaN output until ``wait()``), offload copies (``Transfers.download`` /
``upload``: NaN destination until the event is waited for), the CPU worker's jobs (the
offloaded step, overlap_step's steps begun in backward: run only when their future is
asked for), and NVMe I/O (reads leave NaN bytes, writes read their slot, at the wait).
Any read of a result before its wait (or a wait that never comes) then yields NaN or
stale data, deterministically, and the run no longer matches DDP, the reference here as
in tests/test_parity_ddp.py.

Not reachable on this CUDA-less machine: ``Transfers.upload_cast`` (a host master cast
into a device parameter shard; on the CPU both are in one memory and the shard takes the
master in place). It uploads through ``upload``, which the harness defers.
"""

from __future__ import annotations

import functools
import shutil
import tempfile

import pytest

from _launch import CaseResults, launch_cases

pytestmark = pytest.mark.multiprocess

CASES = [dict(stage=s, precision=p, accum=a, optimizer="sgd")
         for s in (1, 2, 3) for p in ("fp32", "bf16") for a in (1, 2)]
CASES.append(dict(stage=3, precision="fp32", accum=1, persistence=200))
# CPU offload: bf16 gradient shards are downloaded to an fp32 host copy (fp32 ones are read in
# place on the CPU); stage-3 parameter offload uploads each shard as part of its gather
CASES += [dict(stage=s, precision="bf16", accum=a, offload_optimizer="cpu", optimizer="sgd")
          for s in (2, 3) for a in (1, 2)]
CASES += [dict(stage=3, precision=p, accum=2, offload_optimizer="cpu", offload_params="cpu", optimizer="sgd")
          for p in ("fp32", "bf16")]
# NVMe: the disk reads, the write-backs, and stage 3's gathers issued at wait (_DeferredHandle)
CASES += [dict(stage=3, precision="fp32", accum=2, offload_optimizer="nvme", offload_params="nvme",
               optimizer="sgd"),
          dict(stage=2, precision="bf16", accum=1, offload_optimizer="nvme")]
# overlap_step: group steps begun on the CPU worker during backward, collected by step()
CASES += [dict(stage=s, precision="bf16", accum=a, offload_optimizer="cpu", overlap_step=True)
          for s, a in ((2, 1), (3, 2))]
CASES += [dict(stage=3, precision="fp32", accum=2, offload_optimizer="nvme", offload_params="nvme",
               overlap_step=True, optimizer="sgd")]
# hybrid sharding, 2 shard groups of 2 ranks: the cross-group all-reduce reads the reduce-scatter's output
HYBRID_CASES = [dict(stage=s, precision="fp32", accum=2, optimizer="sgd", shard_group_size=2) for s in (2, 3)]
HYBRID_CASES += [dict(stage=3, precision="bf16", accum=1, optimizer="sgd", shard_group_size=2,
                      offload_optimizer="cpu", offload_params="cpu")]

TOL = {"fp32": (1e-5, 1e-5), "bf16": (2e-3, 5e-2)}  # (losses, weights): as tests/test_offload_parity.py
#: two optimizer steps, not the worker's default four: every deferred operation runs at step 1 (the
#: optimizer state created, on the host or written to NVMe) and again at step 2 (that state read back and
#: updated, under a changed lr); with accum=2 each step accumulates two micro-batches; steps 3 and 4 repeat step 2
STEPS = 2


def _key(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(case.items()) if k not in ("defer", "nvme_path", "steps"))


@functools.lru_cache(maxsize=None)
def results(world_size: int) -> CaseResults:
    path = tempfile.mkdtemp(prefix="zs_deferred_nvme_")
    try:
        cases = CASES if world_size == 2 else HYBRID_CASES
        return launch_cases("parity.py", world_size, [dict(c, defer=True, nvme_path=path, steps=STEPS) for c in cases],
                            key=lambda res: _key(res["case"]), timeout=400)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _assert_matches_ddp(per_rank: list[dict], case: dict) -> None:
    loss_tol, weight_tol = TOL[case["precision"]]
    for rank, res in enumerate(per_rank):
        assert len(res["losses_zero"]) == len(res["losses_ref"]) == STEPS
        for step, (lz, lr) in enumerate(zip(res["losses_zero"], res["losses_ref"])):
            assert abs(lz - lr) <= loss_tol * abs(lr), f"rank {rank} step {step}: {lz} vs DDP {lr}"
        assert res["weight_rel_diff"] <= weight_tol, (rank, res["worst_tensor"], res["weight_rel_diff"])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_deferred_operations_still_match_ddp(case):
    per_rank = results(2).of(_key(case))
    _assert_matches_ddp(per_rank, case)
    if case.get("overlap_step"):  # the steps did begin in backward
        for res in per_rank:
            assert res["steps_overlapped"] == len(res["losses_zero"]) * res["trainable_groups"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", HYBRID_CASES, ids=_key)
def test_deferred_operations_with_hybrid_sharding_still_match_ddp(case):
    _assert_matches_ddp(results(4).of(_key(case)), case)
