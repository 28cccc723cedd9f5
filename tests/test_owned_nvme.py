"""Optimizers that need whole tensors (Muon, Adafactor) with their optimizer state on NVMe.

See [Note: the ownership layout on NVMe] in _optim/owned_runs.py. The same judgement as
tests/test_owned_optimizers.py (2 gloo ranks against DDP and against one process on the
global batch, same tolerances and for the same reasons: see its docstring), at stages 1-3
with ``offload_optimizer`` on NVMe and, at stage 3, the parameter shards too (the
``zero3_offload_nvme`` preset's placement), in fp32 and bf16. Two slot sizes: 16 KiB, where
a block's owned matrices come in whole with their state, and 4096 bytes, where none fits a
slot, so each owned group steps in runs of whole parameters (a matrix larger than a slot in
a buffer of its own): the path a chunked flat step would get wrong by cutting matrices.

Also: the per-parameter state really rests in the swap file (not kept in memory beside
it), and a checkpoint saved with NVMe offload resumes at another world size, judged
against one process that trained without interruption.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import zero_strategy as zs
from _compare import rel_diff
from _launch import launch_cases, launch_named_cases_with_nvme
from _models import TinyLM, batch, loss_fn
from _models import whole_tensor_recipe as optimizers
from zero_strategy._optim.owned_runs import plan_runs

pytestmark = pytest.mark.multiprocess

SMALL = 4096  # no owned matrix fits one slot: every owned group steps in runs


def _case(recipe, stage, precision, buffer_size=4096 * 4, params=False):
    name = f"{recipe}-z{stage}-{precision}-nvme{'-params-nvme' if params else ''}{'-runs' if buffer_size == SMALL else ''}"
    return dict(name=name, recipe=recipe, stage=stage, precision=precision, offload_optimizer="nvme",
                offload_params="nvme" if params else None, buffer_size=buffer_size)


CASES = [
    *(_case(recipe, stage, "fp32") for recipe in ("muon", "adafactor") for stage in (1, 2)),
    *(_case(recipe, 3, "fp32", params=True) for recipe in ("muon", "adafactor")),
    _case("muon", 3, "bf16", params=True),
    _case("adafactor", 2, "bf16"),
    *(_case(recipe, stage, "fp32", SMALL) for recipe in ("muon", "adafactor") for stage in (1, 2)),
    *(_case(recipe, 3, "fp32", SMALL, params=True) for recipe in ("muon", "adafactor")),
    _case("muon", 3, "bf16", SMALL, params=True),
    # overlap_step: the groups' runs are stepped on the worker thread while backward goes on
    dict(_case("adafactor", 2, "fp32", SMALL), name="adafactor-z2-fp32-nvme-runs-overlap", overlap_step=True),
]
VS_DDP = {"fp32": 1e-5, "bf16": 5e-2}
VS_SINGLE = {"muon": 3e-2, "adafactor": 1e-4}
#: three optimizer steps per case, not the worker's default six: the per-parameter state (Muon's momentum,
#: Adafactor's factored moments) is created and written to the swap file at step 1, and read back, updated
#: and written again at steps 2 and 3; steps 4 to 6 repeat them
STEPS = 3


@functools.lru_cache(maxsize=None)
def _results():
    return launch_named_cases_with_nvme("owned_optimizers.py", [dict(c, steps=STEPS) for c in CASES], "zs_owned_nvme_",
                                        timeout=500)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_whole_tensor_optimizers_on_nvme_match_ddp_and_one_process(case):
    for rank, res in enumerate(_results().of(case["name"])):
        assert res["owned_groups"] and res["stepped_on_host"], res
        assert res["moved"] > 1e-3, "the weights did not train"
        assert res["vs_ddp"] <= VS_DDP[case["precision"]], (rank, res)
        assert res["loss_vs_ddp"] <= (1e-5 if case["precision"] == "fp32" else 2e-3), (rank, res)
        if case["precision"] == "fp32":
            assert res["vs_single"] <= VS_SINGLE[case["recipe"]], (rank, res)
        nvme = res["volume"]["nvme"]
        assert nvme["in_runs"] == (case["buffer_size"] == SMALL), nvme
        assert nvme["swapped"] > 0, "the per-parameter optimizer state is not in the swap file"


def _train(model, opts, steps):
    for step in steps:
        pairs = [batch(r, step, 0) for r in range(2)]
        loss_fn(model(torch.cat([t for t, _ in pairs])), torch.cat([t for _, t in pairs])).backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


def _nvme(path, buffer_size):
    return {"device": "nvme", "path": str(path), "buffer_size": buffer_size}


@pytest.mark.parametrize("recipe", ["muon", "adafactor"])
def test_a_checkpoint_saved_with_nvme_resumes_at_another_world_size(tmp_path, recipe):
    """2 ranks at stage 3 with everything on NVMe save after 3 steps and train 3 more; the checkpoint
    resumed on 1 rank (NVMe again, runs of whole parameters) ends where they ended. And 1 rank on NVMe
    saves after 3 steps; 2 ranks on NVMe resume it and end where one uninterrupted process ends."""
    torch.manual_seed(1234)
    base = TinyLM(layers=3)
    one = copy.deepcopy(base)
    one, zopts = zs.setup(one, optimizers(one, recipe),
                          zs.ZeroConfig(stage=1, offload_optimizer=_nvme(tmp_path / "swap1", SMALL)))
    _train(one, zopts, range(3))
    zs.save_checkpoint(tmp_path / "from1", one, zopts)
    zs.teardown(one)
    nvme = str(tmp_path / "swap2")
    cases = [dict(name="2to1", recipe=recipe, stage=3, precision="fp32", offload_optimizer="nvme",
                  offload_params="nvme", nvme_path=nvme, save_at=3, ckpt=str(tmp_path / "from2"),
                  final=str(tmp_path / "final.pt")),
             dict(name="1to2", recipe=recipe, stage=3, precision="fp32", offload_optimizer="nvme",
                  offload_params="nvme", nvme_path=nvme, buffer_size=SMALL, load_from=str(tmp_path / "from1"),
                  start=3)]
    results = launch_cases("owned_optimizers.py", 2, cases, key=lambda r: r["name"], timeout=300)
    tol = VS_SINGLE[recipe]
    for res in results.of("1to2"):
        assert res["vs_single"] <= tol and res["vs_ddp"] <= tol, res

    final = torch.load(tmp_path / "final.pt")
    diffs = {}
    for with_state in (True, False):
        model = copy.deepcopy(base)
        cfg = zs.ZeroConfig(stage=3, param_persistence_threshold=0,
                            offload_optimizer=_nvme(tmp_path / "swap3", SMALL))
        model, zopts = zs.setup(model, optimizers(model, recipe), cfg)
        zs.load_checkpoint(tmp_path / "from2", model, zopts if with_state else None)
        _train(model, zopts, range(3, 6))
        diffs[with_state] = rel_diff(zs.full_state_dict(model), final)
        zs.teardown(model)
    print(f"{recipe}: resumed on NVMe at 1 rank vs uninterrupted 2-rank run {diffs[True]:.2e}, "
          f"without the state {diffs[False]:.2e}")
    assert diffs[True] <= tol, diffs
    assert diffs[False] > 3 * max(diffs[True], tol / 10), diffs  # the state was restored, not started afresh


class OddSizes(torch.nn.Module):
    """Three matrices and their biases directly on one module (one flat group), of sizes that are no
    multiple of the 2048-element alignment, so that runs share the aligned block at their edges."""

    def __init__(self):
        super().__init__()
        dims = [40, 37, 53, 29]
        for k, (i, o) in enumerate(zip(dims, dims[1:])):
            self.register_parameter(f"w{k}", torch.nn.Parameter(torch.randn(o, i) / i ** 0.5))
            self.register_parameter(f"b{k}", torch.nn.Parameter(torch.zeros(o)))

    def forward(self, x):
        for k in range(3):
            x = torch.nn.functional.linear(x, getattr(self, f"w{k}"), getattr(self, f"b{k}"))
            x = torch.nn.functional.gelu(x) if k < 2 else x
        return x


def _odd_recipe(model, recipe):
    matrices = [getattr(model, f"w{k}") for k in range(3)]
    biases = [getattr(model, f"b{k}") for k in range(3)]
    if recipe == "muon":
        return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(biases, lr=1e-2)]
    return [torch.optim.Adafactor(matrices + biases, lr=1e-2)]


@pytest.mark.parametrize("recipe", ["muon", "adafactor"])
def test_runs_of_whole_parameters_step_as_one_process(tmp_path, recipe):
    """One rank, slots of 28 KiB: the owned group (5k elements) streams in runs, neighbouring runs
    share an aligned block, and with Adafactor (biases in the group) a run holds a matrix and its
    bias; 4 steps equal one plain torch.optim process on the same batches (the same arithmetic on
    the same values)."""
    torch.manual_seed(0)
    base = OddSizes()
    xs = [torch.randn(8, 40, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def train(model, opts):
        for x in xs:
            model(x).square().mean().backward()
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad()

    ref = copy.deepcopy(base)
    train(ref, _odd_recipe(ref, recipe))
    model = copy.deepcopy(base)
    cfg = zs.ZeroConfig(stage=1, offload_optimizer=_nvme(tmp_path, 7 * 4096))
    model, zopts = zs.setup(model, _odd_recipe(model, recipe), cfg)
    owned = [g for g in zs.api._engine_of(model).groups if g.owned]
    assert any(g.masters.streams for g in owned), [g.numel for g in owned]  # stepped in runs
    runs = [len(r) for g in owned if g.masters.streams for z in zopts
            for r in plan_runs(z.owned_views(g), g.swap.pool.slot_bytes)]
    assert len(runs) >= 3 and (recipe == "muon" or max(runs) >= 2), runs
    train(model, zopts)
    assert rel_diff(zs.full_state_dict(model), ref.state_dict()) <= 1e-6
    zs.teardown(model)


def test_the_optimizer_state_dict_carries_the_swapped_state(tmp_path):
    """``optimizer.state_dict()`` of an NVMe run holds the per-parameter state (read from the swap
    file, not the empty tensors that stand for it in memory): loaded into a fresh NVMe run on one
    rank, training goes on as one uninterrupted torch.optim process (the same arithmetic); with the
    weights alone it does not."""
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    ref = copy.deepcopy(base)
    _train(ref, optimizers(ref, "muon"), range(4))

    def run(swap):
        model = copy.deepcopy(base)
        cfg = zs.ZeroConfig(stage=2, offload_optimizer=_nvme(tmp_path / swap, SMALL))
        return zs.setup(model, optimizers(model, "muon"), cfg)

    model, zopts = run("a")
    _train(model, zopts, range(2))
    saved = [z.state_dict() for z in zopts]
    weights = zs.full_state_dict(model)
    momenta = [v["momentum_buffer"] for v in saved[0]["optimizer"]["state"].values()]
    assert momenta and all(m.numel() > 0 and m.abs().sum() > 0 for m in momenta)
    zs.teardown(model)
    diffs = {}
    for with_state in (True, False):
        model, zopts = run(f"b{with_state}")
        model.load_state_dict(weights)
        if with_state:
            for z, sd in zip(zopts, saved):
                z.load_state_dict(sd)
        _train(model, zopts, range(2, 4))
        diffs[with_state] = rel_diff(zs.full_state_dict(model), ref.state_dict())
        zs.teardown(model)
    assert diffs[True] <= 1e-6 and diffs[False] > 1e-4, diffs
