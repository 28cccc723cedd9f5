"""CPU offload trains exactly like DDP: optimizer offload for stages 1-3 and parameter
offload for stage 3, fp32 / bf16 / fp16, with and without clipping and accumulation.

The offloaded step runs group by group on a CPU worker thread with the user's own
optimizer; on this CUDA-less machine it takes the same code path as on a GPU
(unpinned buffers, synchronous copies). Tolerances as in test_parity_ddp.py; on 2
ranks the results are bit-identical.
"""

from __future__ import annotations

import functools

import pytest

from _launch import CaseResults, launch_cases

CASES = [dict(stage=s, precision=p, accum=a, offload_optimizer="cpu")
         for s in (1, 2, 3) for p in ("fp32", "bf16", "fp16") for a in (1, 2)]
CASES += [dict(stage=3, precision=p, accum=a, offload_optimizer="cpu", offload_params="cpu")
          for p in ("fp32", "bf16") for a in (1, 2)]
CASES += [dict(stage=3, precision="bf16", accum=1, offload_params="cpu")]       # parameters only
CASES += [dict(stage=s, precision=p, accum=2, offload_optimizer="cpu", clip=0.05)
          for s in (1, 2, 3) for p in ("fp32", "bf16")]
CASES += [dict(stage=3, precision="fp32", accum=2, offload_optimizer="cpu", offload_params="cpu",
               clip=0.05, clip_in_config=True, optimizer="sgd")]
CASES += [dict(stage=s, precision="fp32", accum=2, offload_optimizer="cpu", defer=True, optimizer="sgd")
          for s in (1, 3)]

TOL = {"fp32": (1e-5, 1e-5), "fp16": (2e-4, 2e-2), "bf16": (2e-3, 5e-2)}
#: two optimizer steps, not the worker's default four: the optimizer state (Adam moments, SGD momentum)
#: is created on the host at step 1 and read back and updated at step 2, the scheduler's lr changes
#: between them, and with accum=2 each step accumulates two micro-batches; steps 3 and 4 repeat step 2
STEPS = 2


def _key(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(case.items()) if k != "steps")


@functools.lru_cache(maxsize=None)
def results() -> CaseResults:
    return launch_cases("parity.py", 2, [dict(c, steps=STEPS) for c in CASES], key=lambda res: _key(res["case"]),
                        timeout=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_offload_matches_ddp(case):
    loss_tol, weight_tol = TOL[case["precision"]]
    for rank, res in enumerate(results().of(_key(case))):
        assert len(res["losses_zero"]) == len(res["losses_ref"]) == STEPS
        for step, (lz, lr) in enumerate(zip(res["losses_zero"], res["losses_ref"])):
            assert abs(lz - lr) <= loss_tol * abs(lr), f"rank {rank} step {step}: {lz} vs DDP {lr}"
        assert res["weight_rel_diff"] <= weight_tol, (rank, res["worst_tensor"], res["weight_rel_diff"])
        assert res["skipped_zero"] == res["skipped_ref"]
        for z, r in zip(res["norms_zero"], res["norms_ref"]):
            if r != float("inf"):
                assert z == pytest.approx(r, rel=1e-4 if case["precision"] == "fp32" else 1e-2)
