"""Activation-checkpoint offload: the checkpoint inputs, and only they, go to the host; training is unchanged.

On a CPU the placement is a no-op (host memory is the device), so what is checked here is the
mechanism (See [Note: activation offload] in src/zero_strategy/_model/activation_offload.py): the
saved-tensor hooks put around each ``checkpoint(...)`` see exactly one tensor per checkpointed
layer, its input, with both of torch's checkpoints (counted against ``estimate_activations``'
``layer_input``, the bytes a checkpointed layer keeps), and gradients equal those of the same model
trained without checkpointing. The CUDA test (skipped without a GPU) checks the placement itself:
the device memory held between forward and backward falls by the layers' inputs.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zero_strategy as zs
from zero_strategy._model.activation_offload import OffloadCounts, offload_counts, offloaded
from zero_strategy.estimate import estimate_activations

from _models import step_beside

transformers = pytest.importorskip("transformers")


def _blocks(n=3, dim=8):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim)) for _ in range(n))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_the_hooks_see_each_checkpoint_input_once_and_gradients_are_unchanged(use_reentrant):
    blocks, plain = _blocks(), None
    plain = copy.deepcopy(blocks)
    counts = OffloadCounts()
    run = offloaded(checkpoint, counts)
    x = torch.randn(2, 5, 8, requires_grad=True)
    h = x
    for block in blocks:
        h = run(block, h, use_reentrant=use_reentrant)
    h.square().sum().backward()
    assert (counts.tensors, counts.bytes, counts.moved_bytes) == (3, 3 * 2 * 5 * 8 * 4, 0)
    x2 = x.detach().clone().requires_grad_()
    h2 = x2
    for block in plain:
        h2 = block(h2)
    h2.square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    for a, b in zip(blocks.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_offloaded_checkpoint_is_a_drop_in_for_torch_checkpoint():
    blocks = _blocks()
    x = torch.randn(4, 8, requires_grad=True)
    out = zs.offloaded_checkpoint(blocks[0], x)
    want = checkpoint(blocks[0], x, use_reentrant=False)
    torch.testing.assert_close(out, want)
    (g,) = torch.autograd.grad(out.sum(), x)
    (w,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(g, w)


def _llama(layers=3):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(3)
    return cfg, transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("enable", ["before_setup", "after_setup"])
def test_a_checkpointed_hf_model_offloads_every_layer_input_and_trains_like_the_plain_model(enable):
    """``gradient_checkpointing_enable()`` before or after setup, as the Trainer may call it; with the
    tiled loss too (the two compose)."""
    config, base = _llama()
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    if enable == "before_setup":
        model.gradient_checkpointing_enable()
    model, opt = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.5),
                          {"stage": 3, "param_persistence_threshold": 0, "activation_offload": True,
                           "tiled_loss": True})
    if enable == "after_setup":
        model.gradient_checkpointing_enable()
    steps, (b, s) = 2, (2, 16)
    for step in range(steps):
        ids = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(step))
        outputs, want = step_beside(model, opt, ref, ref_opt, dict(input_ids=ids, labels=ids))
        assert outputs.loss.item() == pytest.approx(want.item(), rel=1e-6)
    counts = offload_counts(model)
    per_forward = config.num_hidden_layers * estimate_activations(config, b, s, "fp32").layer_input
    assert (counts.tensors, counts.bytes) == (steps * config.num_hidden_layers, steps * per_forward)
    trained = zs.full_state_dict(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    layer = model.model.layers[0]
    zs.teardown(model)
    assert not getattr(layer._gradient_checkpointing_func, "offloads_to_host", False)  # torch's own again
    assert offload_counts(model) is None


def test_without_checkpointing_nothing_is_offloaded():
    _, model = _llama()
    model, _ = zs.setup(model, None, {"stage": 1, "activation_offload": True})
    ids = torch.randint(0, 128, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert offload_counts(model).tensors == 0
    zs.teardown(model)


def test_a_model_without_checkpointing_layers_is_refused_with_the_fix():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="offloaded_checkpoint"):
        zs.setup(model, None, {"stage": 3, "activation_offload": True})
    assert not zs.is_set_up(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_layer_inputs_leave_the_device_until_backward():
    dim, layers, tokens = 1024, 4, 8192
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers)).cuda()
    x = torch.randn(tokens, dim, device="cuda", requires_grad=True)

    def held_after_forward(run) -> tuple[int, torch.Tensor]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        h = x
        for block in blocks:
            h = run(block, h)
        out = h.square().sum()
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # the allocator frees blocks the side stream has finished with
        held = torch.cuda.memory_allocated() - before
        (grad,) = torch.autograd.grad(out, x)
        return held, grad

    kept, grad_kept = held_after_forward(lambda f, h: checkpoint(f, h, use_reentrant=False))
    counts = OffloadCounts()
    moved, grad_moved = held_after_forward(lambda f, h: offloaded(checkpoint, counts)(f, h, use_reentrant=False))
    inputs = (layers - 1) * tokens * dim * 4  # the first input is x itself, which the caller holds
    assert counts.moved_bytes == layers * tokens * dim * 4
    assert kept - moved >= inputs * 0.95, (kept, moved)
    torch.testing.assert_close(grad_moved, grad_kept)
