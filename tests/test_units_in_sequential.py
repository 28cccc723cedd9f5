"""Repeated blocks held in ``nn.Sequential`` (and nested containers) become units; stage 3 trains like DDP.

timm's ViT keeps its blocks in ``nn.Sequential``, torchvision's ResNet its stages as
Sequentials of residual blocks. Auto-detection must find those blocks (the rule is
``[Note: choosing units]`` in _engine/units.py), must not cut an ordinary MLP
``nn.Sequential(Linear, ReLU, Linear)`` into one unit per layer, and when stage 3
finds no unit at all it must say so once, with the number of parameters gathered
every forward and candidate ``unit_classes``.

Parity: 2 gloo ranks train TinyViT and TinyResNet (tests/_block_models.py) at stage 3
next to torch DDP; losses and final state dicts within 1e-5 relative (fp32, as
tests/test_parity_ddp.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import zero_strategy as zs
from _block_models import Block, TinyResNet, TinyViT
from _launch import launch
from zero_strategy._engine.units import find_unit_modules

TOL = 1e-5
VIT_UNITS = ["blocks.0", "blocks.1", "blocks.2"]
RESNET_UNITS = ["layer1.0", "layer1.1", "layer2.0", "layer2.1", "layer3.0", "layer3.1"]


def units_of(model: nn.Module, unit_classes: tuple[str, ...] = ()) -> list[str]:
    return [name for name, _ in find_unit_modules(model, unit_classes)]


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 8))


# ------------------------------------------------------------------ which modules are units
def test_timm_style_vit_blocks_in_a_sequential_are_units():
    assert units_of(TinyViT()) == VIT_UNITS


def test_torchvision_style_resnet_blocks_of_each_stage_are_units():
    """The downsample Sequential(conv, bn) inside a block stays in its block (units never nest)."""
    assert units_of(TinyResNet()) == RESNET_UNITS


def test_an_mlp_sequential_of_single_layers_has_no_units():
    assert units_of(mlp()) == []
    assert units_of(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU())) == []  # VGG-like


def test_blocks_in_nested_containers_are_found():
    model = nn.Sequential(
        nn.Linear(16, 16),                                               # stem: a single layer
        nn.Sequential(Block(16, 2), Block(16, 2)),                       # a stage: Sequential in Sequential
        nn.ModuleDict({"enc": nn.Sequential(Block(16, 2), Block(16, 2)),  # Sequential in ModuleDict
                       "dec": nn.ModuleList([Block(16, 2)])}),            # ModuleList in ModuleDict
        nn.Sequential(nn.ModuleList([Block(16, 2), Block(16, 2)])),       # ModuleList in Sequential
    )
    assert units_of(model) == ["1.0", "1.1", "2.enc.0", "2.enc.1", "2.dec.0", "3.0.0", "3.0.1"]


def test_a_block_class_that_does_not_repeat_in_its_container_is_looked_into():
    model = nn.Sequential(Block(16, 2), nn.Linear(16, 4), nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)]))
    # one Block is no stack; the ModuleList's children are units; the Block is large beside them, so it
    # becomes one too (See [Note: large modules outside the blocks]), the small head does not
    assert units_of(model) == ["0", "2.0", "2.1"]


def test_sibling_attributes_of_one_class_on_an_ordinary_module_are_not_units():
    """Like T5's encoder and decoder: the blocks inside them are the units, not the two halves."""
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(Block(16, 2), Block(16, 2))

    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = Stack(), Stack()

    assert units_of(EncoderDecoder()) == ["encoder.layers.0", "encoder.layers.1",
                                          "decoder.layers.0", "decoder.layers.1"]


def test_unit_classes_still_override_detection():
    assert units_of(TinyViT(), ("Mlp",)) == [f"blocks.{i}.mlp" for i in range(3)]
    assert units_of(TinyResNet(), ("Sequential",)) == ["layer1", "layer2", "layer3"]


# ---------------------------------------------------------- the warning when nothing is found
def setup_and_collect(model: nn.Module, config) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    zs.teardown(model, keep_weights=False)
    return [w for w in caught if "no repeated blocks" in str(w.message)]


def test_stage3_without_units_warns_once_with_the_size_and_candidate_classes():
    model = mlp()
    total = sum(p.numel() for p in model.parameters())
    caught = setup_and_collect(model, zs.ZeroConfig(stage=3, param_persistence_threshold=0))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert f"{total:,} sharded parameter elements" in message
    assert "gathered whole at every forward" in message
    assert "unit_classes" in message and "'Linear' (x3)" in message
    assert caught[0].filename == __file__, "the warning points at the user's setup call"


def test_the_warning_counts_only_what_is_gathered():
    model = mlp()  # the two 16,384-element weights are sharded; the rest stays whole below the threshold
    expected = sum(p.numel() for p in model.parameters() if p.numel() >= 1000)
    caught = setup_and_collect(model, zs.ZeroConfig(stage=3, param_persistence_threshold=1000))
    assert len(caught) == 1 and f"{expected:,} sharded parameter elements" in str(caught[0].message)
    assert setup_and_collect(mlp(), zs.ZeroConfig(stage=3)) == []  # all below 100k: nothing is gathered


@pytest.mark.parametrize("stage", [1, 2])
def test_no_warning_at_stages_that_do_not_gather(stage):
    assert setup_and_collect(mlp(), zs.ZeroConfig(stage=stage, param_persistence_threshold=0)) == []


@pytest.mark.parametrize("make", [TinyViT, TinyResNet], ids=["vit", "resnet"])
def test_no_warning_when_units_are_found(make):
    assert setup_and_collect(make(), zs.ZeroConfig(stage=3, param_persistence_threshold=0)) == []


def test_no_warning_when_unit_classes_names_the_root_on_purpose():
    assert setup_and_collect(mlp(), zs.ZeroConfig(stage=3, param_persistence_threshold=0,
                                                  unit_classes=("Sequential",))) == []


# --------------------------------------------------------------------- stage 3 trains like DDP
@pytest.fixture(scope="module")
def parity() -> list[dict]:
    """Each rank's report of one 2-rank run of both models."""
    return launch("block_units.py", 2, {"models": ["vit", "resnet"]}, timeout=240)


def results_for(reports: list[dict], name: str) -> list[dict]:
    per_rank = []
    for rank, rep in enumerate(reports):
        res = next((r for r in rep["results"] if r["model"] == name), None)
        assert res is not None, f"rank {rank} did not run {name}: {[r.get('error') for r in rep['results']]}"
        assert "error" not in res, f"rank {rank}, {name}:\n{res['error']}"
        per_rank.append(res)
    return per_rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("name,units", [("vit", VIT_UNITS), ("resnet", RESNET_UNITS)])
def test_stage3_over_sequential_blocks_matches_ddp(parity, name, units):
    per_rank = results_for(parity, name)
    for rank, res in enumerate(per_rank):
        assert res["units"] == ["<root>"] + units
        for step, (zero, ref) in enumerate(res["losses"]):
            assert abs(zero - ref) <= TOL * abs(ref), f"rank {rank} step {step}: loss {zero} vs DDP {ref}"
        assert res["weight_rel_diff"] <= TOL, (
            f"rank {rank}: final state differs from DDP by {res['weight_rel_diff']:.3g} ({res['worst_tensor']})")
    assert per_rank[0]["losses"][0][1] != per_rank[0]["losses"][-1][1], "training moved the loss"
