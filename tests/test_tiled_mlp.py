"""The tiled MLP gives the untiled MLP's outputs and gradients and keeps none of its intermediates.

Oracles: the same MLP run whole with autograd (outputs, input and parameter gradients, fp32 to
rounding); the same Hugging Face model not set up, trained by the same loop (stages 1 and 3, with
and without gradient checkpointing); and the bytes autograd saves, measured through
``saved_tensors_hooks``: the tiled model saves exactly the MLPs' four intermediates per layer less
(4·e·s·b·f bytes, as [Note: activation memory of a Llama-style decoder] counts them). A hook on a
parameter fires once per backward with the whole gradient, as without tiling (See [Note: the tiled
MLP] in src/zero_strategy/_model/tiled_mlp.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zero_strategy as zs
from zero_strategy._model.tiled_mlp import TiledMLPFunction

from _models import saved_storages, step_beside

transformers = pytest.importorskip("transformers")


def _config(layers=2, hidden=32, width=96):
    return transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=width,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    tie_word_embeddings=False)


def _mlp():
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    return LlamaMLP(_config())


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_outputs_and_gradients_match_the_whole_mlp_and_parameter_hooks_fire_once(chunk):
    mlp = _mlp()
    names = tuple(n for n, _ in mlp.named_parameters())
    params = [p for _, p in mlp.named_parameters()]
    fired = []
    mlp.gate_proj.weight.register_hook(lambda g: fired.append(g.clone()))
    x = torch.randn(2, 23, 32, requires_grad=True)
    out = TiledMLPFunction.apply(mlp, names, chunk, x, *params)
    torch.testing.assert_close(out, mlp(x), rtol=1e-6, atol=1e-6)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *params], grad)
    want = torch.autograd.grad(mlp(x), [x, *params], grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert len(fired) == 2  # once for the tiled backward, once for the whole one: never per chunk
    torch.testing.assert_close(fired[0], fired[1], rtol=1e-5, atol=1e-6)


def _saved_bytes(model, ids) -> int:
    with saved_storages(model) as storages:
        model(input_ids=ids, labels=ids, use_cache=False).loss
    return sum(storages.values())


def test_the_tiled_model_saves_none_of_the_mlp_intermediates():
    config = _config()
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).train()
    model, _ = zs.setup(copy.deepcopy(plain), None, {"stage": 1, "tiled_mlp": 4})
    b, s = 2, 24
    ids = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(0))
    mlp_intermediates = config.num_hidden_layers * 4 * 4 * b * s * config.intermediate_size  # 4e·sbf, fp32
    assert _saved_bytes(plain, ids) - _saved_bytes(model, ids) == mlp_intermediates
    zs.teardown(model)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("stage", [1, 3])
def test_a_hf_model_with_tiled_mlps_trains_like_the_model_itself(stage, checkpointing):
    torch.manual_seed(3)
    base = transformers.LlamaForCausalLM(_config())
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    if checkpointing:
        model.gradient_checkpointing_enable()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model, opt = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.5),
                          {"stage": stage, "param_persistence_threshold": 0, "tiled_mlp": 5, "tiled_loss": 7})
    for step in range(2):
        ids = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(step))
        outputs, want = step_beside(model, opt, ref, ref_opt, dict(input_ids=ids, labels=ids))
        assert outputs.loss.item() == pytest.approx(want.item(), rel=1e-6)
    trained = zs.full_state_dict(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    zs.teardown(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_model_without_a_gated_mlp_is_refused():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="gated MLP"):
        zs.setup(model, None, {"stage": 3, "tiled_mlp": True})
    assert not zs.is_set_up(model)
    with pytest.raises(zs.ZeroConfigError, match="tiled_mlp"):
        zs.ZeroConfig(tiled_mlp=0)


def test_the_activation_estimate_counts_what_the_tiled_model_saves():
    from zero_strategy.estimate import estimate_activations

    config = _config()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model, _ = zs.setup(transformers.LlamaForCausalLM(config).train(), None, {"stage": 1, "tiled_mlp": 4})
    for b, s in [(1, 8), (2, 24)]:
        ids = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(s))
        estimate = estimate_activations(config, b, s, "fp32", "sdpa", tiled_mlp=4)
        assert abs(estimate.without_checkpointing - _saved_bytes(model, ids)) <= 8 * b
        assert estimate.mlp_transient == 4 * 4 * b * 4 * config.intermediate_size and estimate.tiled_mlp == 4
    zs.teardown(model)
