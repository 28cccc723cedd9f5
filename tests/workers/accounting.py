"""Measure what the engine holds and sends, for the memory and communication tests.

args["cases"]: list of {stage, precision}. Per case: two training steps of TinyLM
with AdamW; the memory report is taken after the second backward (every kind of
model state exists then: parameters, reduced gradients, masters, Adam moments),
the communication counters cover the second step (forward, backward, step): the engine's own
(``comm``) and, counted outside the package by wrapping ``torch.distributed``'s collectives
(workers/_dist_counter.py), what every call moved (``outside``).
Parameter counts come from the unsharded model, before setup.
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist

import _dist_counter
from _worker import finish, start
from _models import TinyLM, batch, loss_fn, param_groups

_dist_counter.install()  # before zero_strategy is imported: it binds collectives at import
import zero_strategy as zs  # noqa: E402


def counts(model: torch.nn.Module) -> dict:
    unique = {id(p): (n, p) for n, p in model.named_parameters()}.values()
    return dict(
        trainable=sum(p.numel() for _, p in unique if p.requires_grad),
        frozen=sum(p.numel() for _, p in unique if not p.requires_grad),
        # outside the ModuleList blocks: the root unit, kept gathered forward-to-backward in stage 3
        root=sum(p.numel() for n, p in unique if not n.startswith("layers.")),
    )


def run_case(case: dict) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM(layers=case.get("layers", 4))
    numbers = counts(model)
    opt = torch.optim.AdamW(param_groups(model))
    model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=case["stage"], precision=case["precision"],
                                                     param_persistence_threshold=0,
                                                     offload_optimizer=case.get("offload_optimizer"),
                                                     offload_params=case.get("offload_params")))
    report = None
    accum = case.get("accum", 1)
    for step in range(2):
        if step == 1:
            _dist_counter.reset()
        for micro in range(accum):
            tokens, targets = batch(rank, step, micro)
            quiet = case.get("no_sync") and micro < accum - 1
            with zs.no_sync(model) if quiet else contextlib.nullcontext():
                zopt.backward(loss_fn(model(tokens), targets) / accum)
        if step == 1:
            with _dist_counter.paused():  # a report, no part of the step
                report = zs.memory_report(model)
        zopt.step()
        zopt.zero_grad()
    outside = _dist_counter.counts()
    largest_shard = max(g.shard_numel for g in zs.api._engine_of(model).groups)
    return dict(case=case, counts=numbers, memory=report.by_category, placement=report.by_placement,
                comm=zs.comm_stats(model), outside=outside, largest_shard=largest_shard)


class Wide(torch.nn.Module):
    """``blocks`` square fp32 Linear layers of width ``width``: one unit each, megabytes each,
    so that what the engine holds stands out of the process's own working memory."""

    def __init__(self, width: int, blocks: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(blocks))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def rss_case(case: dict) -> dict:
    """Anonymous RSS growth since before the model was built, beside the engine's own accounting
    (``memory_report``), after setup, after forward/backward and after the step."""
    from _rss import anon_rss, trim_heap

    gc.collect()
    trim_heap()  # the heap's free pages would take setup's first allocations without RSS growing
    base = anon_rss()
    torch.manual_seed(0)
    model = Wide(case["width"], case["blocks"])
    params = sum(p.numel() for p in model.parameters())
    largest_unit = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
    opt = torch.optim.AdamW(model.parameters())
    model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=case["stage"], precision=case["precision"],
                                                     param_persistence_threshold=0,
                                                     offload_optimizer=case.get("offload_optimizer"),
                                                     offload_params=case.get("offload_params")))
    phases = {}

    def measure(phase):
        gc.collect()
        phases[phase] = dict(rss_growth=anon_rss() - base, accounted=zs.memory_report(model).total)

    measure("setup")
    x = torch.randn(4, case["width"], generator=torch.Generator().manual_seed(dist.get_rank()))
    zopt.backward(model(x).pow(2).mean())
    measure("backward")
    zopt.step()
    measure("step")
    return dict(case=case, params=params, largest_unit=largest_unit, phases=phases)


def main() -> None:
    args, out = start()
    if args.get("rss"):
        from _rss import return_freed_memory_to_the_os
        return_freed_memory_to_the_os()
        finish(out, {"results": [rss_case(c) for c in args["cases"]]})
    finish(out, {"results": [run_case(c) for c in args["cases"]]})


if __name__ == "__main__":
    main()
