"""Stage 3 outside the plain loop: eval, early exits, state dicts, gathered parameters.

Compared with DDP on the same data: forwards in eval/no_grad at different depths
(units used out of the usual order, prefetched units never used), a forward whose
output is dropped, ``full_state_dict`` (all ranks and rank 0 only), and
``gathered_parameters`` for reading and for a modification made on one rank.
"""

from __future__ import annotations

import functools

import pytest

from _launch import launch


@functools.lru_cache(maxsize=None)
def reports(world_size: int, prefetch: int = 1):
    return launch("stage3_access.py", world_size, {"prefetch": prefetch}, timeout=180)


CONFIGS = [(2, 1), (2, 2), pytest.param(4, 1, marks=pytest.mark.slow)]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size,prefetch", CONFIGS)
def test_eval_and_early_exit_forwards_match_ddp(world_size, prefetch):
    for rep in reports(world_size, prefetch):
        assert len(rep["eval_diffs"]) == 9
        assert max(rep["eval_diffs"]) < 1e-5
        assert max(rep["train_loss_diffs"]) < 1e-5
        assert rep["units_gathered_after"] == [], "a unit stayed gathered after eval/odd forwards"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size,prefetch", CONFIGS)
def test_full_state_dict_all_ranks_and_rank0_only(world_size, prefetch):
    reps = reports(world_size, prefetch)
    for rank, rep in enumerate(reps):
        assert rep["full_vs_ddp"] < 1e-5
        if rank == 0:
            assert rep["rank0_only_keys"] > 0 and rep["rank0_only_vs_full"] == 0.0
        else:
            assert rep["rank0_only_keys"] == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size,prefetch", CONFIGS)
def test_gathered_parameters_read_and_modify(world_size, prefetch):
    for rep in reports(world_size, prefetch):
        assert rep["gathered_shape"] == [48, 24]
        assert rep["gathered_vs_ddp"] < 1e-5
        assert rep["bytes_after"] <= 4, "parameters were not re-sharded after the context"
        assert rep["shape_after"] == [48, 24], "a released parameter keeps its true shape"
        assert rep["after_modify_vs_ddp"] < 1e-6
        assert rep["final_vs_ddp"] < 1e-5
