"""An optimizer class whose ``step`` calls ``super().step()`` (a logging or lookahead subclass)
steps under ZeRO as torch's base class does.

torch wraps a class's ``step`` with its hook runner the first time an instance of that class is
built, so such a subclass's ``super().step()`` reaches the base class's wrapped step, which fires
the instance's step pre-hooks, among them the guard that refuses a direct step on the re-homed
optimizer. Whether it did depended on whether any plain ``AdamW`` had been built in the process
before: the same script failed or ran depending on what came first.
"""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs

from _models import TinyLM, batch, loss_fn, param_groups


class LoggingAdamW(torch.optim.AdamW):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        return super().step(closure)


def _train(optimizer_class, preset: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TinyLM()
    model, optimizer = zs.setup(model, optimizer_class(param_groups(model)), preset)
    for step in range(2):
        tokens, targets = batch(0, step, 0)
        loss_fn(model(tokens), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    with zs.gathered_parameters(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["zero2", "zero2_offload", "zero3"])
def test_a_subclass_calling_super_step_matches_its_base_class(preset):
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # a plain AdamW built first, as in most processes
    base = _train(torch.optim.AdamW, preset)
    subclass = _train(LoggingAdamW, preset)
    for name, value in base.items():
        assert torch.equal(subclass[name], value), name
