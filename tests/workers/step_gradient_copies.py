"""One process trains a stack of 12 blocks (50M parameters) in bf16 and reports what the optimizer
step adds to its memory, and what it holds after ``zero_grad`` (tests/test_step_gradient_copies.py).

argv: preset, swap directory (NVMe presets). glibc is told to return freed blocks to the OS
(tests/_rss.py), so resident memory follows what is held. Prints one JSON line: the third
step's peak resident growth above the RSS just before ``optimizer.step()`` (VmHWM; the first step
created the optimizer state, and NVMe's staging slots grew to it in the second), the growth of
anonymous RSS from after setup to after the last ``zero_grad``, the growth of the engine's staging
buffers over the same span, the model's parameter elements and one block's.
"""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

from _rss import anon_rss, return_freed_memory_to_the_os, status_bytes

import zero_strategy as zs

BLOCKS, WIDTH = 12, 1024  # large enough that an fp32 copy of every gradient exceeds the bounds (the test)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def step_peak(optimizer) -> int:
    """Peak resident growth of one ``optimizer.step()`` above the resident set before it."""
    before = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    optimizer.step()
    return status_bytes("VmHWM") - before


def main(preset: str, swap: str) -> None:
    return_freed_memory_to_the_os()
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.Linear(WIDTH, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kw = {}
    if "nvme" in preset:
        nvme = zs.NVMeOffload(path=swap)
        kw = dict(offload_optimizer=nvme, offload_params=nvme)
    config = zs.ZeroConfig.preset(preset, precision="bf16", **kw)
    model, optimizer = zs.setup(model, optimizer, config)
    staging_at_setup = zs.memory_report(model).by_category["staging"]
    after_setup = anon_rss()
    # one token: the gradients (what the step casts) have the parameters' size whatever the batch,
    # and CPU bf16 matmuls are slow (4 tokens cost 0.8 CPU-s more per step, measured 2026-12-08)
    x = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(1))
    for step in range(3):  # the first creates the state; NVMe's slots grow to it in the second
        model(x).float().pow(2).mean().backward()
        staging_before = zs.memory_report(model).by_category["staging"]
        peak = step_peak(optimizer)
        # staging slots the step added (a slow disk keeps more reads and writes in flight): the
        # engine's own category, bounded by the NVMe pool, not a gradient copy
        step_staging = zs.memory_report(model).by_category["staging"] - staging_before
        optimizer.zero_grad()
    engine = zs.memory_report(model)
    print(json.dumps(dict(step_peak=peak, step_staging_growth=step_staging, rest_growth=anon_rss() - after_setup,
                          staging_growth=engine.by_category["staging"] - staging_at_setup,
                          kept_for_next_step=engine.kept_bytes,
                          numel=sum(p.numel() for p in model.parameters()),
                          block=sum(p.numel() for p in model[0].parameters()))))

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
