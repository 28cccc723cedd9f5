"""A checkpoint saved under sequence parallelism resumes without it, and the other way round,
landing on the weights of one uninterrupted process: SP changes where activations live,
never what a checkpoint holds.

Issue 40. tests/workers/sequence_parallel_cases.py (``mode: train``): 2 steps with
``sequence_parallel_size=2`` on 2 ranks, saved, then 2 more on one process without SP
(and 2 steps on one process, saved, then 2 more at sp 2 on 2 ranks); the reference trains
4 steps on one process. SGD with momentum, so the optimizer state must travel too.
"""

from __future__ import annotations

import pytest
import torch

from _launch import launch

TOL = 1e-5


def train(tmp_path, world: int, sp: int, steps: int, **paths) -> list[float]:
    args = dict(mode="train", sp=sp, steps=steps, **{k: str(tmp_path / v) for k, v in paths.items()})
    reports = launch("sequence_parallel_cases.py", world, args, timeout=300)
    return reports[0]["losses"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoints_cross_sequence_parallel_sizes_both_ways(tmp_path):
    want = train(tmp_path, 1, 1, 4, weights="ref.pt")
    first = train(tmp_path, 2, 2, 2, save="ckpt_sp2")
    rest = train(tmp_path, 1, 1, 2, load="ckpt_sp2", weights="from_sp2.pt")
    first_plain = train(tmp_path, 1, 1, 2, save="ckpt_sp1")
    rest_sp = train(tmp_path, 2, 2, 2, load="ckpt_sp1", weights="from_sp1.pt")
    ref = torch.load(tmp_path / "ref.pt")
    for got_losses, name in ((first + rest, "from_sp2.pt"), (first_plain + rest_sp, "from_sp1.pt")):
        for step, (got, w) in enumerate(zip(got_losses, want, strict=True)):
            assert abs(got - w) <= TOL * abs(w), f"{name} step {step}: {got} vs uninterrupted {w}"
        got = torch.load(tmp_path / name)
        worst = max((got[k].double() - v.double()).abs().max().item() / v.double().abs().max().item()
                    for k, v in ref.items())
        assert worst <= TOL, (name, worst)
    assert want[0] != want[-1]
