"""On a CUDA device every stage trains like plain single-GPU training (skipped without CUDA).

One process (a world of one): the same engine path as on CPU, with CUDA tensors,
bf16 compute and fp32 masters, against the textbook fp32-master recipe.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zero_strategy as zs
from _models import TinyLM, batch, loss_fn, param_groups

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_matches_plain_training_on_gpu(stage, precision):
    torch.manual_seed(0)
    base = TinyLM(layers=3).cuda()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    master = copy.deepcopy(base)
    compute = copy.deepcopy(base).to(dtype)
    ref_opt = torch.optim.AdamW(param_groups(master))
    model = copy.deepcopy(base)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)),
                           zs.ZeroConfig(stage=stage, precision=precision, param_persistence_threshold=0))
    for step in range(3):
        tokens, targets = (t.cuda() for t in batch(0, step, 0))
        ref_loss = loss_fn(compute(tokens), targets)
        ref_loss.backward()
        for pm, pc in zip(master.parameters(), compute.parameters()):
            if pc.grad is not None:
                pm.grad = pc.grad.float()
                pc.grad = None
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for pm, pc in zip(master.parameters(), compute.parameters()):
                pc.copy_(pm)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-4)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    full = zs.full_state_dict(model)
    # in host memory, gathered one group at a time: the device held at most one group beyond its shards
    largest = max(g.padded_numel * 4 for g in zs.api._engine_of(model).groups)
    assert torch.cuda.max_memory_allocated() - before <= 2 * largest + 2 ** 20
    assert all(t.device.type == "cpu" for t in full.values())
    for name, t in master.state_dict().items():
        if name != "frozen_mix":
            torch.testing.assert_close(full[name], t.float().cpu(), rtol=1e-4, atol=1e-5)
    assert zs.memory_report(model).by_location.get("cuda", {}).get("params", 0) > 0
