"""``zero_auto`` chooses on the peak, model states + working set: a preset whose resting states
fit but whose working set does not is passed over.

Oracle, by hand, for 32 square bias-free bf16 linears of u = d² elements (d = 4096, no root),
N = 8 ranks, Adam (Ψ = 32u; P = G = 2, K = 12), with 75% of the device usable:

| preset | resting (ZeRO formula) | working set | peak |
|---|---|---|---|
| zero2 | 2Ψ + 14Ψ/8 = 120u | buckets 2·5u = 10u | 130u |
| zero3, prefetch 1 | 16Ψ/8 = 64u | window 2·2u + buckets 10u = 14u | 78u |
| zero3, prefetch 8 | 64u | window 2·9u + buckets 10u = 28u | 92u |
| zero2_offload | 2Ψ + 2Ψ/8 = 72u | buckets 10u | 82u |

(the padding allowance, 8·33·7 elements, is far below u and does not move a choice).
"""

from __future__ import annotations

import torch
from torch import nn

from zero_strategy import AvailableMemory, choose_preset

D, LAYERS, N = 4096, 32, 8
U = D * D
HOST = 1024 * 2**30


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(LAYERS))


def chosen(device_units: float, **fields) -> str:
    with torch.device("meta"):
        model = Stack()
    mem = AvailableMemory(device=int(device_units * U / 0.75), host=HOST, nvme=None)
    cfg = choose_preset(model, {"preset": "zero_auto", "precision": "bf16", **fields}, world_size=N, available=mem)
    offload = getattr(cfg.offload_optimizer, "device", None)
    return {(2, None): "zero2", (3, None): "zero3", (2, "cpu"): "zero2_offload"}[cfg.stage, offload]


def test_zero2_is_passed_over_when_its_gradient_buckets_do_not_fit():
    assert chosen(131) == "zero2"
    assert chosen(125) == "zero3"  # zero2's 120u of model states fit, its 130u peak does not


def test_a_wider_prefetch_window_moves_stage_3_to_offload():
    assert chosen(85) == "zero3"  # prefetch 1: 78u
    assert chosen(85, prefetch=8) == "zero2_offload"  # zero3's 64u fit, its 92u peak does not: 82u does
