"""The ownership layout in one process: the layout's arithmetic, the balance on a Llama, the choice of
layout per optimizer and its refusals, and Muon / Adafactor at every stage against torch on one rank.

See [Note: the ownership layout] in _engine/flat.py. The 2-rank runs against DDP are in
tests/test_owned_optimizers.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zero_strategy as zs
from _compare import rel_diff
from _models import TinyLM, batch, loss_fn, param_groups, tiny_llama_config
from zero_strategy._engine.flat import ownership_layout


def _check_layout(numels, world):
    offsets, owner_of, shard = ownership_layout(numels, world)
    spans = sorted((o, o + n) for o, n in zip(offsets, numels))
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0, "two parameters overlap"
    for o, n, r in zip(offsets, numels, owner_of):
        assert r * shard <= o and o + n <= (r + 1) * shard, "a parameter is not whole in its owner's shard"
    return offsets, owner_of, shard


@pytest.mark.parametrize("numels,world", [
    ([6, 5, 4, 3, 2, 1], 2), ([100, 1, 1], 4), ([7], 3), ([3, 3, 3], 1), ([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)])
def test_every_parameter_lies_whole_in_its_owners_shard(numels, world):
    _, owner_of, shard = _check_layout(numels, world)
    assert shard == max(sum(n for n, r in zip(numels, owner_of) if r == k) for k in range(world))


def test_a_parameter_larger_than_the_even_share_sets_the_shard_and_others_fill_the_rest():
    _, owner_of, shard = _check_layout([100, 10, 10, 10], 2)
    assert shard == 100 and owner_of == [0, 1, 1, 1]


def test_ranks_may_own_nothing_in_a_group_and_ties_go_to_the_ranks_owning_least_overall():
    load = [0, 0, 0]
    _, first, _ = ownership_layout([5], 3, load)
    _, second, _ = ownership_layout([5], 3, load)
    _, third, _ = ownership_layout([5], 3, load)
    assert (first, second, third) == ([0], [1], [2]) and load == [5, 5, 5]


def _llama_block_matrices(config):
    """Per decoder layer, the elements of its 2-D matrices: the flat group Muon's param group makes."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return [[p.numel() for p in layer.parameters() if p.ndim == 2] for layer in model.model.layers]


def llama_balance(config, world: int) -> tuple[float, float]:
    """(max/mean bytes per rank over the whole model, worst padding of one group over its real bytes)."""
    load, worst_pad = [0] * world, 0.0
    for numels in _llama_block_matrices(config):
        _, _, shard = ownership_layout(numels, world, load)
        worst_pad = max(worst_pad, shard * world / sum(numels) - 1)
    return max(load) / (sum(load) / world), worst_pad


@pytest.mark.parametrize("world", [2, 4, 8])
def test_balance_on_a_llama(world):
    """Llama-3.2-1B's shapes (16 layers, 2048 wide, GQA 8 of 32 heads, 8192 MLP), Muon on the hidden
    matrices: the most loaded rank owns within a few percent of the mean over the model."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    ratio, pad = llama_balance(config, world)
    print(f"Llama-3.2-1B shapes, Muon groups, {world} ranks: max/mean bytes per rank {ratio:.4f}, "
          f"worst group padding {pad:.1%}")
    assert ratio <= {2: 1.01, 4: 1.05, 8: 1.15}[world], ratio


def _muon_recipe(model):
    hidden = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2 and n.startswith("layers.")]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not (p.ndim == 2 and n.startswith("layers."))]
    return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]


def _train(model, opts, steps=4):
    for step in range(steps):
        tokens, targets = batch(0, step, 0)
        loss_fn(model(tokens), targets).backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


@pytest.mark.parametrize("recipe", ["muon", "adafactor"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_rank_equals_torch(recipe, stage):
    make = _muon_recipe if recipe == "muon" else (lambda m: [torch.optim.Adafactor(param_groups(m, lr=1e-2))])
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    ref = copy.deepcopy(base)
    _train(ref, make(ref))
    model = copy.deepcopy(base)
    model, zopts = zs.setup(model, make(model), zs.ZeroConfig(stage=stage, param_persistence_threshold=0))
    assert any(g.owned for g in zs.api._engine_of(model).groups)
    _train(model, zopts)
    assert rel_diff(zs.full_state_dict(model), ref.state_dict()) <= 1e-6
    assert rel_diff(model.state_dict(), ref.state_dict()) <= 1e-6  # through the slots at stage 3 too
    zs.teardown(model)


def test_elementwise_optimizers_keep_the_flat_layout():
    model = TinyLM(layers=2)
    model, _ = zs.setup(model, _muon_recipe(model), "zero2")
    groups = zs.api._engine_of(model).groups
    assert {g.optimizer_index for g in groups if g.owned} == {0}
    assert not any(g.owned for g in groups if g.trainable and g.optimizer_index == 1)


class _LionLike(torch.optim.Optimizer):
    """An optimizer of the user's own, in neither table."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def test_an_optimizer_in_no_table_is_refused_naming_the_owned_layout():
    model = TinyLM(layers=2)
    with pytest.raises(TypeError, match="_LionLike.*optimizer_layout='owned'"):
        zs.setup(model, _LionLike(model.parameters()), "zero2")


def test_the_owned_layout_steps_any_per_tensor_optimizer():
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    ref = copy.deepcopy(base)
    _train(ref, [_LionLike([p for p in ref.parameters() if p.requires_grad])])
    model = copy.deepcopy(base)
    model, zopt = zs.setup(model, _LionLike([p for p in model.parameters() if p.requires_grad]),
                           zs.ZeroConfig(stage=3, optimizer_layout="owned", param_persistence_threshold=0))
    _train(model, [zopt])
    assert rel_diff(zs.full_state_dict(model), ref.state_dict()) <= 1e-6


@pytest.mark.parametrize("make,why", [
    (lambda m: torch.optim.LBFGS(m.parameters()), "LBFGS: it needs a closure"),
    (lambda m: torch.optim.SparseAdam(list(m.parameters())), "SparseAdam: it needs sparse gradients"),
])
@pytest.mark.parametrize("layout", ["auto", "owned"])
def test_what_no_layout_can_shard_is_refused_by_name(make, why, layout):
    model = TinyLM(layers=2)
    with pytest.raises(TypeError, match=why):
        zs.setup(model, make(model), zs.ZeroConfig(stage=2, optimizer_layout=layout))


def test_optimizer_layout_is_validated():
    with pytest.raises(zs.ZeroConfigError, match="optimizer_layout.*did you mean 'owned'"):
        zs.ZeroConfig(optimizer_layout="ownd")
    assert zs.ZeroConfig.from_dict({"optimizer_layout": "owned"}).optimizer_layout == "owned"
    assert zs.ZeroConfig.from_dict(zs.ZeroConfig(optimizer_layout="owned").to_dict()).optimizer_layout == "owned"


def test_a_hugging_face_llama_with_muon_on_its_hidden_matrices():
    """The recipe on a real model: hidden 2-D matrices to Muon, embeddings and norms to AdamW."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(tiny_llama_config())

    def recipe(m):
        hidden = [p for n, p in m.named_parameters() if p.ndim == 2 and ".layers." in n]
        rest = [p for n, p in m.named_parameters() if not (p.ndim == 2 and ".layers." in n)]
        return [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]

    def train(m, opts):
        for step in range(3):
            ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(step))
            m(input_ids=ids, labels=ids).loss.backward()
            for o in opts:
                o.step()
                o.zero_grad()

    ref = copy.deepcopy(base)
    train(ref, recipe(ref))
    model = copy.deepcopy(base)
    model, zopts = zs.setup(model, recipe(model), zs.ZeroConfig(stage=3, param_persistence_threshold=0))
    train(model, zopts)
    assert rel_diff(zs.full_state_dict(model), ref.state_dict()) <= 1e-6


def test_nvme_optimizer_offload_keeps_the_ownership_layout(tmp_path):
    """Muon with its state on NVMe is set up, not refused: its groups are owned and their masters rest
    in the swap file (training with it: tests/test_owned_nvme.py)."""
    model = TinyLM(layers=2)
    cfg = zs.ZeroConfig(stage=2, offload_optimizer={"device": "nvme", "path": str(tmp_path)})
    model, _ = zs.setup(model, _muon_recipe(model), cfg)
    owned = [g for g in zs.api._engine_of(model).groups if g.owned]
    assert owned and all(g.swap is not None and g.master.numel() == 0 for g in owned)  # evicted: on disk
    zs.teardown(model)


def test_a_checkpoint_resumed_with_another_optimizer_layout_is_refused(tmp_path):
    """AdamW saved in flat shards, resumed as whole parameters (optimizer_layout='owned'): a clear error,
    and the weights alone still load. Resuming across world sizes: tests/test_owned_optimizers.py."""
    def adamw(m):
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)

    model = TinyLM(layers=2)
    model, zopt = zs.setup(model, adamw(model), "zero2")
    _train(model, [zopt], steps=1)
    zs.save_checkpoint(tmp_path / "ckpt", model, zopt)
    other = TinyLM(layers=2)
    other, other_opt = zs.setup(other, adamw(other), zs.ZeroConfig(stage=2, optimizer_layout="owned"))
    with pytest.raises(zs.CheckpointError, match="saved for flat shards but is kept here as whole parameters"):
        zs.load_checkpoint(tmp_path / "ckpt", other, other_opt)
    zs.load_checkpoint(tmp_path / "ckpt", other)
    assert rel_diff(zs.full_state_dict(other), zs.full_state_dict(model)) == 0.0


def test_offload_states_moves_per_parameter_state_and_brings_it_back_bit_for_bit():
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    ref = copy.deepcopy(base)
    _train(ref, _muon_recipe(ref))
    model = copy.deepcopy(base)
    model, zopts = zs.setup(model, _muon_recipe(model), "zero2")
    _train(model, zopts, steps=2)
    momentum = [v["momentum_buffer"] for g in zopts[0].groups for v in zopts[0].group_states(g)]
    assert momentum, "Muon built no state"
    before = zs.memory_report(model).by_category["optimizer_state"]
    zs.offload_states(model, zopts, include=["optim_states"])
    assert zs.memory_report(model).by_placement.get("offloaded", {}).get("optimizer_state", 0) >= before
    zs.reload_states(model, zopts)
    for step in range(2, 4):  # the rest of _train's steps
        tokens, targets = batch(0, step, 0)
        loss_fn(model(tokens), targets).backward()
        for o in zopts:
            o.step()
        for o in zopts:
            o.zero_grad()
    assert rel_diff(zs.full_state_dict(model), ref.state_dict()) <= 1e-6


@pytest.mark.parametrize("recipe,precision", [("muon", "bf16"), ("adafactor", "fp16")])
def test_low_precision_trains_close_to_fp32(recipe, precision):
    """fp16 unscales (and skips an overflowing step) before the owner's step, as for flat groups; the
    fp32 reference takes the steps that were not skipped. One optimizer for fp16: with two, each has
    its own loss scale, and one loss cannot be scaled for both."""
    make = _muon_recipe if recipe == "muon" else (lambda m: [torch.optim.Adafactor(param_groups(m, lr=1e-2))])
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    model = copy.deepcopy(base)
    model, zopts = zs.setup(model, make(model), zs.ZeroConfig(stage=3, precision=precision,
                                                              param_persistence_threshold=0))
    taken = []
    for step in range(6):
        tokens, targets = batch(0, step, 0)
        zopts[0].backward(loss_fn(model(tokens), targets))
        skipped = sum(z.skipped_steps for z in zopts)
        for o in zopts:
            o.step()
        for o in zopts:
            o.zero_grad()
        if sum(z.skipped_steps for z in zopts) == skipped:
            taken.append(step)
    assert len(taken) >= 4, taken
    ref = copy.deepcopy(base)
    ref_opts = make(ref)
    for step in taken:
        tokens, targets = batch(0, step, 0)
        loss_fn(ref(tokens), targets).backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
    assert rel_diff(zs.full_state_dict(model), ref.state_dict()) <= 5e-2
