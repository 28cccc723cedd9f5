"""2 ranks: offload/reload round trips at every stage end bit for bit equal to the run without
them, and offloading the optimizer state frees this rank's 8 bytes per master element."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from _worker import finish, start
from _rollout import same, train

import zero_strategy as zs

CONFIGS = {
    "zero1": zs.ZeroConfig(stage=1),
    "zero2": zs.ZeroConfig(stage=2),
    "zero3": zs.ZeroConfig(stage=3, param_persistence_threshold=0),
    "zero3_bf16": zs.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0),
    "zero2_offload": zs.ZeroConfig.preset("zero2_offload"),
}


def main() -> None:
    args, out = start()
    rank = dist.get_rank()
    cases = {}
    try:
        for name, config in CONFIGS.items():
            ref = train(config, rank=rank)
            run = train(config, include=None, at="before_step", rank=rank)
            optim = train(config, include=["optim_states"], at="after_step", rank=rank, steps=1)
            engine_free = optim["reports"]
            cases[name] = {
                "same": same(run, ref) and run["losses"] == ref["losses"],
                "optim_dropped": engine_free["before"].device_bytes - engine_free["offloaded"].device_bytes,
                "adam_formula": 8 * _shard_elements(config),
                "trainable": _trainable(),
                "all_dropped": run["reports"]["before"].device_bytes - run["reports"]["offloaded"].device_bytes,
                "device_before": run["reports"]["before"].device_bytes,
            }
            if name == "zero2_offload":  # the state already lives on the host: nothing to free
                cases[name]["adam_formula"] = 0
                cases[name]["trainable"] = 0
        finish(out, {"cases": cases})
    except Exception:  # noqa: BLE001 - reported to the test
        import traceback
        finish(out, {"error": traceback.format_exc(), "cases": cases})


def _trainable() -> int:
    from _models import TinyLM
    model = TinyLM(layers=3)
    return sum(p.numel() for p in {id(p): p for p in model.parameters() if p.requires_grad}.values())


def _shard_elements(config) -> int:
    """This rank's master elements (padded shards), from a set-up model's layout."""
    from _models import TinyLM, param_groups
    model = TinyLM(layers=3)
    model, _ = zs.setup(model, torch.optim.AdamW(param_groups(model)), config)
    n = sum(g.shard_numel for g in zs.api._engine_of(model).trainable_groups)
    zs.teardown(model, keep_weights=False)
    return n


if __name__ == "__main__":
    main()
