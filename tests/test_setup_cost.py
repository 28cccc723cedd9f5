"""Setting up a model of many small parameter tensors (a mixture of experts with tens of
thousands of them) costs what DDP's construction costs: no work per parameter that grows
with the model's other parameters or units, and no collective per parameter.

Counted, not timed (2 gloo ranks): the Python calls setup makes (cProfile's count, builtins
included) grow linearly from 500 to 2,500 one-element parameters (a scan of every unit per
parameter made them grow 25-fold from 2,000 to 10,000), and the initial weights go from rank 0 in
a handful of broadcasts (one per tensor cost 0.7 ms each: 7.5 s of 9.6 s at 10,000). Those broadcasts are
exact: every rank starts from rank 0's parameters and buffers, whatever their dtype, with
buckets split and tensors larger than a bucket sent alone. benchmarks/setup_bench.py times it
against DDP (RESULTS.md, "Setup time").
"""

from __future__ import annotations

import functools

import pytest

from _launch import launch

# Five times the tensors: linear work grows 5x (bound 1.3 x 5 = 6.5), work per tensor that scans
# every unit grows up to 25x. Measured on 2026-12-08 (torch's CPU build, 2 ranks): 120-241 calls per
# tensor at both sizes, growth 4.92-4.97. Calls a*n + b*n^2 grow (5a + 25bn) / (a + bn) from n to 5n.
# The unit scan grew them 25-fold from 2,000: even at 20-fold, bn = 3a at 2,000, so bn = 0.75a at
# 500 and the growth from 500 is (5 + 25 x 0.75) / 1.75 = 13.6 > 6.5. 2,000 and 10,000 tensors told
# the same apart at over twice the CPU: the module took 43.9 CPU-s with them, 18.5 and 16.8 with 500
# and 2,500 (2026-12-08, pytest's start-up included).
SMALL, LARGE = 500, 2_500


@functools.lru_cache(maxsize=None)
def reports() -> list[dict]:
    cases = [dict(model=m, n=n, stage=s) for m in ("params", "experts") for s in (1, 3) for n in (SMALL, LARGE)]
    cases += [dict(model="mixed", n=40, stage=s, bucket_bytes=64) for s in (1, 2, 3)]
    return launch("setup_cost.py", 2, {"cases": cases}, timeout=300)


def results() -> list[tuple[int, dict]]:
    found = []
    for rank, rep in enumerate(reports()):
        for res in rep["results"]:
            assert "error" not in res, res["error"]
            found.append((rank, res))
    return found


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["params", "experts"])
@pytest.mark.parametrize("stage", [1, 3])
def test_setup_work_grows_linearly_with_the_parameter_tensors(model, stage):
    calls = {res["case"]["n"]: res["calls"] for rank, res in results()
             if rank == 0 and res["case"]["model"] == model and res["case"]["stage"] == stage}
    growth = calls[LARGE] / calls[SMALL]
    assert growth < 1.3 * LARGE / SMALL, (calls, growth)  # linear, with a margin for fixed costs
    # and a constant per tensor: 110-215 calls today, most of them torch's own (hooks, named_parameters)
    assert calls[LARGE] / LARGE < 400, calls


@pytest.mark.multiprocess
def test_initial_weights_are_broadcast_in_buckets_not_per_tensor():
    for rank, res in results():
        if res["case"]["model"] != "mixed":
            assert res["broadcasts"] <= 4, (rank, res["case"], res["broadcasts"])


@pytest.mark.multiprocess
def test_every_rank_starts_from_rank_0s_weights_and_buffers():
    checked = 0
    for rank, res in results():
        assert res["keys_match"] and res["same_on_every_rank"], (rank, res["case"])
        if rank == 0:
            assert res["as_rank0"], res["case"]
        checked += res["case"]["model"] == "mixed"
    assert checked == 6  # small buckets: many bucket splits, and the Linear's weight sent alone
