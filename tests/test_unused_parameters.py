"""Ranks that use different parameters in a step train exactly like the plain model on the
global batch (what DDP with ``find_unused_parameters=True`` computes), at every stage, with
and without CPU offload.

Issue #26: before the reduce order and the gather schedule (see [Note: reduce order] in
_engine/reduce.py, [Note: gather schedule] in _engine/units.py), a mixture of experts whose ranks'
samples reach different experts trained 35% off at stage 2 (same-sized expert groups paired
across ranks) and stages 2-3 hung on an image tower only one rank ran. A parameter no rank
used must not move at all (DDP leaves its ``.grad`` None and the optimizer skips it): an
expert inside a block, a projector on text-only steps and an adapter in a block's flat
group moved 0.4-0.9% through weight decay and momentum before [Note: members get their own
flat groups] (_engine/units.py) and [Note: no gradient on any rank] (_engine/gradients.py).

The models are in tests/_routed_models.py, the worker in tests/workers/routed.py; each case
trains 4 steps with weight decay (AdamW, or SGD with momentum), so a parameter stepped
without a gradient would move. The oracle is the final full weights (each rank's loss is
its own batch's, the reference's the global batch's).
"""

from __future__ import annotations

import functools

import pytest

from _launch import launch

SHAPES = [dict(model="moe"), dict(model="vlm"), dict(model="early_exit"),
          dict(model="moe", routing="shared"), dict(model="vlm", images_on=[0, 1]),
          # an expert no rank uses, inside a block: the experts are members with groups of their own
          dict(model="moe_blocks", routing="shared"),
          # steps with no image on any rank, then images again: the projector is a root part of its own
          dict(model="vlm", text_only_steps=[1, 2]),
          # an adapter no rank runs after step 0 shares its block's flat group: kept out of the steps
          dict(model="adapter", adapter_steps=[0]),
          dict(model="adapter", adapter_steps=[0, 3], optimizer="sgd"),
          # ... and first used at step 2: the momentum the first steps created (weight decay alone
          # would have written wd * p into it) starts from zero there, as DDP's first buffer
          dict(model="adapter", adapter_steps=[2, 3], optimizer="sgd")]
CASES = [dict(shape, stage=stage, offload=offload)
         for stage in (1, 2, 3) for offload in (None, "cpu") for shape in SHAPES]
#: ... and runs again at step 3, with AdamW: the one difference left (the group's shared step
#: count), which must be said, not silent
WARNED = [dict(model="adapter", adapter_steps=[0, 3], stage=stage, offload=None) for stage in (1, 3)]
#: a projector frozen at setup, unfrozen after, and run on rank 0 only: refused on both ranks at
#: once (rank 1 has no gradient for it and learns it from the step agreement, instead of waiting)
REFUSED = [dict(model="vlm", unfreeze="projector", stage=stage, offload=None) for stage in (2, 3)]
#: the loop clears gradients with model.zero_grad(): it must reach the reduced gradient this rank
#: holds of an expert or a tower only another rank used (it trained 10.8% off at every stage)
CLEARED_BY_MODEL = [dict(shape, stage=stage, offload=None, clear="model")
                    for stage in (1, 2, 3) for shape in (dict(model="moe"), dict(model="vlm", text_only_steps=[1, 2]))]
#: which parameters have a .grad after backward, beside DDP with find_unused_parameters=True (stages
#: 2-3, which agree at the end of backward; stage 1 agrees in the step, which reduces)
LIKE_DDP = [dict(shape, stage=stage, offload=None, grads_like_ddp=True)
            for stage in (2, 3) for shape in (dict(model="moe"), dict(model="vlm", text_only_steps=[1, 2]))]
#: Adafactor steps whole parameters (the ownership layout): a parameter no rank used gets no
#: gradient and is skipped, its own step count included, so even the adapter used again at step 3
#: is exact, with no warning (where AdamW's flat group shares one count); on NVMe with 4 KiB slots
#: the groups step in runs of whole parameters (See [Note: the ownership layout on NVMe])
WHOLE = [dict(shape, stage=stage, offload=offload, optimizer="adafactor")
         for stage in (1, 2, 3) for offload in (None, "cpu", {"device": "nvme", "buffer_size": 4096})
         for shape in (dict(model="adapter", adapter_steps=[0, 3]), dict(model="moe"))]
TOL = 1e-5  # fp32: both sides add the same two ranks' gradients


def _key(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(case.items()))


@functools.lru_cache(maxsize=None)
def reports(stage: int) -> tuple:
    """Raw per-rank results of one launch per stage (asserted in the tests, not here)."""
    # REFUSED last: it ends the loop
    cases = [c for c in CASES + WHOLE + CLEARED_BY_MODEL + LIKE_DDP + WARNED + REFUSED if c["stage"] == stage]
    return tuple(launch("routed.py", 2, {"cases": cases}, timeout=240))


def per_rank(case: dict, ok: bool = True) -> list[dict]:
    """Each rank's result of ``case``; ``ok``: it finished without an error."""
    out = []
    for rank, rep in enumerate(reports(case["stage"])):
        res = next((r for r in rep["results"] if r["case"] == case), None)
        assert res is not None, f"rank {rank} never reached {case}: {rep['results'][-1]}"
        assert not ok or "error" not in res, f"rank {rank}:\n{res['error']}"
        out.append(res)
    return out


def _matches_the_plain_model(case: dict) -> None:
    for rank, res in enumerate(per_rank(case)):
        assert res["weight_rel_diff"] <= TOL, (rank, res["worst"], res["weight_rel_diff"])
        assert res["losses_ref"][0] != res["losses_ref"][-1]  # it trained
        assert res["warnings"] == [], res["warnings"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_matches_the_plain_model_on_the_global_batch(case):
    _matches_the_plain_model(case)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", WHOLE, ids=_key)
def test_whole_parameter_optimizers_skip_unused_parameters_exactly(case):
    _matches_the_plain_model(case)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CLEARED_BY_MODEL, ids=_key)
def test_model_zero_grad_clears_what_other_ranks_brought(case):
    _matches_the_plain_model(case)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", LIKE_DDP, ids=_key)
def test_parameters_have_a_grad_after_backward_where_ddp_gives_them_one(case):
    for rank, res in enumerate(per_rank(case)):
        assert len(res["grads_ddp"]) == 4
        for step, (zero, ddp) in enumerate(zip(res["grads_zero"], res["grads_ddp"])):
            assert zero == ddp, (rank, step, sorted(set(zero) ^ set(ddp)))
        if case["model"] == "moe":  # experts 2-3 only rank 1's samples reach, and 0-1 only rank 0's
            assert all(f"moe.experts.{e}.w1.weight" in step for step in res["grads_zero"] for e in range(4))
        else:  # no rank has images at steps 1-2: the tower has no gradient anywhere
            assert [any(n.startswith("vision_tower.") for n in step) for step in res["grads_zero"]] == [
                True, False, False, True]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", WARNED, ids=_key)
def test_a_parameter_kept_behind_its_groups_step_count_is_warned_about_when_used_again(case):
    for rank, res in enumerate(per_rank(case)):
        assert len(res["warnings"]) == 2, res["warnings"]  # once per block's group
        for block, message in enumerate(res["warnings"]):
            assert f"layers.{block}.adapter.weight" in message and "step count" in message, message


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", REFUSED, ids=_key)
def test_unfreezing_after_setup_on_one_ranks_batch_is_refused_on_every_rank(case):
    for rank, res in enumerate(per_rank(case, ok=False)):
        assert "error" in res, res
        assert "RuntimeError" in res["error"] and "when the model was set up" in res["error"], res["error"]
        # rank 0 had the gradients and names them; rank 1 learned it from the agreement
        assert ("projector.0.weight" in res["error"]) == (rank == 0), (rank, res["error"])
