"""``model.state_dict()`` after setup returns the model's full weights, as DDP's does.

Issue #11: at stage 3 every parameter outside forward is a released shard, and
``state_dict()`` used to return 0-element tensors without a word. Now, on every rank
(it is a collective at stage 3), after a few training steps:

* the model's and a submodule's ``state_dict()`` equal the DDP module's: same keys in
  the same order, same shapes, values within fp32 tolerance, no empty entry;
* the tied head and embedding come out as one tensor under both names, as on DDP;
* each unit is gathered once per call, and none is left gathered afterwards;
* a state dict taken inside ``gathered_parameters`` stays readable after the block;
* training goes on exactly as DDP's (one more step).

Stages 1-2 are the control: the same checks, and no gathering at all.
Worker: tests/workers/state_dict_stage3.py.
"""

from __future__ import annotations

import functools

import pytest

from _launch import CaseResults, launch_cases

CASES = [
    {"name": "stage1", "config": {"stage": 1}},
    {"name": "stage2", "config": {"stage": 2}},
    {"name": "stage3", "config": {"stage": 3, "param_persistence_threshold": 0}},
    {"name": "zero3_offload", "config": {"preset": "zero3_offload", "param_persistence_threshold": 0}},
]
NAMES = [c["name"] for c in CASES]
UNITS = ["<root>", "layers.0", "layers.1", "layers.2"]
TOL = 1e-5  # fp32: relative to each tensor's largest magnitude


@functools.lru_cache(maxsize=None)
def results() -> CaseResults:
    return launch_cases("state_dict_stage3.py", 2, CASES, key=lambda res: res["name"], timeout=240)


def per_rank(name: str) -> list[dict]:
    return results().of(name)


def assert_equals_ddp(cmp: dict, what: str) -> None:
    assert cmp["keys"], f"{what}: keys or their order differ from DDP's state_dict"
    assert cmp["shapes"], f"{what}: shapes differ from DDP's state_dict"
    assert cmp["min_numel"] > 0, f"{what}: an entry has no elements"
    assert cmp["rel"] < TOL, f"{what}: values differ from DDP's by {cmp['rel']:.2e}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_model_state_dict_equals_ddp(name):
    for res in per_rank(name):
        assert_equals_ddp(res["model"], "model.state_dict()")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_submodule_state_dicts_equal_ddp(name):
    for res in per_rank(name):
        assert_equals_ddp(res["block"], "model.layers[1].state_dict()")
        assert_equals_ddp(res["inside_block"], "model.layers[2].fc1.state_dict()")
        assert_equals_ddp(res["head"], "model.head.state_dict()")
        assert_equals_ddp(res["layers"], "model.layers.state_dict()")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_tied_parameters_come_out_as_one_tensor(name):
    for res in per_rank(name):
        assert res["ref_tied_one_tensor"]
        assert res["tied_one_tensor"], "head.weight and embed.weight are two tensors; DDP gives one"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_each_unit_gathered_once_and_released(name):
    for res in per_rank(name):
        sharded = res["stage"] == 3
        assert res["gathers"] == {u: int(sharded) for u in UNITS}
        # block, layer in a block, head, ModuleList of blocks: each unit they hold, once per call
        expected = {"<root>": 1, "layers.0": 1, "layers.1": 2, "layers.2": 2} if sharded else dict.fromkeys(UNITS, 0)
        assert res["submodule_gathers"] == expected
        assert res["gathered_after"] == [] and res["gathered_after_submodules"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_taken_inside_gathered_parameters_stays_valid(name):
    for res in per_rank(name):
        assert_equals_ddp(res["inside_gathered_parameters"], "state_dict() inside gathered_parameters")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_training_continues_exactly(name):
    for res in per_rank(name):
        for lz, lr in res["losses"]:
            assert lz == pytest.approx(lr, rel=TOL)
        assert res["after_step"]["rel"] < TOL
