"""A set-up model is freed like any other once the user drops it; teardown undoes setup.

Oracle for the weights teardown leaves: the same model trained by plain torch (same seed, data,
loop and optimizer) in this process, bit for bit; not ``full_state_dict``, which is the gather
teardown itself runs.
"""

import copy
import gc
import weakref

import torch

import zero_strategy as zs
from _compare import tensor_rel_diff
from _habits import train
from _models import TinyLM, batch, loss_fn


def train_one_step(model, zopt):
    tokens, targets = batch(0, 0, 0)
    loss_fn(model(tokens), targets).backward()
    zopt.step()
    zopt.zero_grad()


def test_dropped_model_and_optimizer_are_collected():
    model = TinyLM(layers=2)
    model, zopt = zs.setup(model, torch.optim.AdamW(model.parameters()), "zero3")
    train_one_step(model, zopt)
    model_ref, engine_ref = weakref.ref(model), weakref.ref(zs.api._engine_of(model))
    del model, zopt
    gc.collect()
    assert model_ref() is None and engine_ref() is None


def test_teardown_leaves_a_plain_module_with_the_trained_weights():
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    plain = copy.deepcopy(model)
    model, zopt = zs.setup(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                           "zero3")
    train(model, zopt, range(2))
    train(plain, torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad]), range(2))
    zs.teardown(model)
    assert model.state_dict().keys() == plain.state_dict().keys()
    for name, want in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], want), (name, tensor_rel_diff(model.state_dict()[name], want))
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not any(m._state_dict_pre_hooks or m._state_dict_hooks or m._load_state_dict_pre_hooks
                   or m._load_state_dict_post_hooks for m in model.modules())
    tokens, _ = batch(0, 1, 0)
    model(tokens).sum().backward()  # plain autograd again: gradients land on the parameters
    assert model.layers[0].fc1.weight.grad is not None
    zs.setup(model, None, "zero2")  # and it can be set up again
