"""The offloaded low-precision Adam/AdamW step in cache-sized windows is the optimizer's own step,
bit for bit (See [Note: the bf16 step in cache-sized windows] in
src/zero_strategy/_optim/adam_windows.py).

Each case trains the same model twice in one process (world of one), CPU offload, bf16 or fp16:
once with the windowed step, once with it turned off (the user's optimizer over the batch, as
before), and compares the masters, every state tensor and the compute-dtype parameters with
``torch.equal``. Windows are made small (a few hundred elements) so that they cut groups at
aligned offsets, hold pieces of several groups, and groups of several param groups share one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zero_strategy as zs
from zero_strategy._optim import adam_windows, offloaded_step


class Blocks(nn.Module):
    """Units of odd sizes (none a multiple of the alignment), one flat group each (two with two
    param groups)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(37, 29), nn.Linear(29, 41), nn.Linear(41, 23), nn.Linear(23, 37)])

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.float().square().mean()


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    if kind == "adamw_groups_tensor_lr":
        return torch.optim.AdamW([{"params": weights, "lr": torch.tensor(3e-3)},
                                  {"params": biases, "lr": torch.tensor(1e-2), "weight_decay": 0.0}],
                                 lr=torch.tensor(1e-2), weight_decay=0.05, fused=True)
    if kind == "adam_amsgrad_maximize":
        return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.01, amsgrad=True, maximize=True,
                                fused=True)
    raise ValueError(kind)


def _train(config: dict, kind: str, steps: int = 4) -> dict:
    torch.manual_seed(0)
    model = Blocks()
    model, opt = zs.setup(model, _optimizer(kind, model), config)
    for i in range(steps):
        x = torch.randn(8, 37, generator=torch.Generator().manual_seed(i))
        loss = model(x.to({"bf16": torch.bfloat16, "fp16": torch.float16}[config["precision"]]))
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    engine = zs.api._engine_of(model)  # the step's in-place writes left no autograd history
    assert all(g.params.tensor.grad_fn is None and g.master.is_leaf for g in engine.trainable_groups)
    with zs.gathered_parameters(model):
        out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for k, (master, state) in enumerate(opt.optimizer.state.items()):
        out[f"master.{k}"] = master.detach().clone()
        out.update({f"state.{k}.{key}": v.clone() for key, v in state.items() if torch.is_tensor(v)})
    zs.teardown(model)
    return out


CASES = [(dict(stage=2, offload_optimizer="cpu", precision="bf16"), "adamw"),
         (dict(stage=2, offload_optimizer="cpu", precision="bf16"), "adamw_groups_tensor_lr"),
         (dict(stage=2, offload_optimizer="cpu", precision="bf16"), "adam_amsgrad_maximize"),
         (dict(stage=2, offload_optimizer="cpu", precision="fp16"), "adamw"),  # a loss-scale factor
         (dict(stage=3, offload_optimizer="cpu", offload_params="cpu", precision="bf16"), "adamw"),
         (dict(stage=1, offload_optimizer="cpu", precision="bf16"), "adamw")]


@pytest.mark.parametrize("window", [64, 320, 1 << 20])
@pytest.mark.parametrize("config,kind", CASES, ids=lambda c: c if isinstance(c, str) else
                         f"stage{c['stage']}-{c['precision']}" + ("-params" if "offload_params" in c else ""))
def test_windowed_step_is_the_optimizers_own(config, kind, window, monkeypatch):
    windowed_calls = []
    real = adam_windows.step_in_windows

    def counted(*args, **kwargs):
        windowed_calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(adam_windows, "WINDOW_NUMEL", window)
    monkeypatch.setattr(offloaded_step, "step_in_windows", counted)
    got = _train(config, kind)
    assert windowed_calls, "the windowed step did not run"
    monkeypatch.setattr(offloaded_step, "window_plan", lambda optimizer, batch: None)
    want = _train(config, kind)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_windows_cut_on_aligned_offsets_and_cover_every_element():
    sizes = [5, 200, 64, 1000, 3, 129]
    for window in (64, 100, 320, 4096):
        covered = [[] for _ in sizes]
        for pieces in adam_windows.windows(sizes, window, align=64):
            assert 0 < sum(b - a for _, a, b in pieces) <= window
            for i, a, b in pieces:
                assert a % 64 == 0 and (b % 64 == 0 or b == sizes[i]), (window, i, a, b)
                covered[i].append((a, b))
        for n, spans in zip(sizes, covered):
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(b == a2 for (_, b), (a2, _) in zip(spans, spans[1:]))


def test_not_windowed_where_it_would_not_be_the_optimizers_own_step(monkeypatch):
    """A subclass with its own step, a non-fused AdamW, SGD: the optimizer's own call, as before."""
    monkeypatch.setattr(offloaded_step, "step_in_windows",
                        lambda *a, **k: pytest.fail("windowed step for an optimizer it does not replicate"))

    class MyAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    for make in (lambda ps: MyAdamW(ps, fused=True), lambda ps: torch.optim.AdamW(ps, foreach=True),
                 lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
        torch.manual_seed(0)
        model = Blocks()
        model, opt = zs.setup(model, make(model.parameters()), dict(stage=2, offload_optimizer="cpu",
                                                                      precision="bf16"))
        for _ in range(2):
            model(torch.randn(8, 37).to(torch.bfloat16)).backward()
            opt.step()
            opt.zero_grad()
        zs.teardown(model)
