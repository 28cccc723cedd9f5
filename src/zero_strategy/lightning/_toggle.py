"""``LightningModule.toggle_optimizer`` for re-homed optimizers.

Lightning's toggle sets ``requires_grad=False`` on every parameter of the other
optimizers, found through ``optimizer.param_groups``. After ``zero_strategy.setup``
those groups hold the fp32 master shards, so the toggle would flip the masters and
leave the model's parameters alone: the other optimizers' parameters would then
collect gradients (from a generator loss into the discriminator, say) that DDP
never computes. This module points the toggle at the model parameters behind each
ZeroOptimizer, with Lightning's semantics (restore on untoggle; parameters of no
optimizer are left alone), as instance attributes that teardown removes.
"""

from __future__ import annotations

import types

from lightning.pytorch import LightningModule

from ._optimizers import zero_optimizer_of


def model_params_of(zero_optimizer) -> list:
    """The model parameters whose master shards ``zero_optimizer`` steps."""
    return zero_optimizer.model_parameters()


def _toggle(module, optimizer) -> None:
    mine = {id(p) for p in model_params_of(zero_optimizer_of(optimizer))}
    state = {}
    for zopt in module.trainer.strategy.zero_optimizers:
        for p in model_params_of(zopt):
            if p not in state:
                state[p] = p.requires_grad
                if id(p) not in mine:
                    p.requires_grad = False
    module._param_requires_grad_state = state


def _untoggle(module, optimizer) -> None:
    for p, requires_grad in getattr(module, "_param_requires_grad_state", {}).items():
        p.requires_grad = requires_grad
    module._param_requires_grad_state = {}


def install(module) -> None:
    """Only where the user's class keeps Lightning's implementation."""
    if type(module).toggle_optimizer is LightningModule.toggle_optimizer:
        module.toggle_optimizer = types.MethodType(_toggle, module)
    if type(module).untoggle_optimizer is LightningModule.untoggle_optimizer:
        module.untoggle_optimizer = types.MethodType(_untoggle, module)


def uninstall(module) -> None:
    for name in ("toggle_optimizer", "untoggle_optimizer"):
        module.__dict__.pop(name, None)
