"""Fabric loops: zero presets against strategy="ddp" (accumulation with no_backward_sync,
global-norm clipping), fabric.save / fabric.load through the sharded format.

args["cases"]: name, strategy (a name, or a dict of ZeroFabricStrategy arguments), precision, clip (max_norm), clip_val (by value), accumulate, steps, save (dir: save after
``steps`` then load into a fresh setup and train ``extra`` more steps).
Rank 0 torch.saves the final weights to <save_dir>/<name>.pt.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from _worker import finish, run_named_cases, start
from _models import SEQ, VOCAB, TinyLM, loss_fn, param_groups

import zero_strategy  # noqa: F401 - registers the presets
from lightning.fabric import Fabric


def batch(step: int, micro: int, rank: int, size: int = 4):
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g), torch.randint(0, VOCAB, (size, SEQ), generator=g)


def build(fabric: Fabric):
    torch.manual_seed(1234)
    model = TinyLM(layers=2)
    opt = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))
    return fabric.setup(model, opt)


def train(fabric, model, opt, case, steps: range, losses: list) -> None:
    accumulate = case.get("accumulate", 1)
    for step in steps:
        for micro in range(accumulate):
            tokens, targets = batch(step, micro, fabric.global_rank)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = loss_fn(model(tokens), targets) / accumulate
                fabric.backward(loss)
            losses.append(float(loss))
        if case.get("clip"):
            norm = fabric.clip_gradients(model, opt, max_norm=case["clip"])
            losses.append(float(norm))
        if case.get("clip_val"):
            fabric.clip_gradients(model, opt, clip_val=case["clip_val"])
        opt.step()
        opt.zero_grad()


def refused_strict_load(fabric, case: dict) -> dict:
    """``fabric.load`` of a state with a key the checkpoint lacks (strict): Fabric's KeyError, and
    before it nothing of the checkpoint loaded (issue 38; before, the model was loaded first)."""
    from _refused_load import differences, snapshot

    model, opt = build(fabric)
    train(fabric, model, opt, case, range(1), [])
    fabric.save(case["refused"], {"model": model, "optimizer": opt, "step": 1})
    train(fabric, model, opt, case, range(1, 2), [])  # the state moves on past the checkpoint
    before = snapshot(model._forward_module, opt)
    try:
        fabric.load(case["refused"], {"model": model, "optimizer": opt, "step": 0, "absent": 1})
        raised = None
    except Exception as err:  # noqa: BLE001 - reported to the test
        raised = f"{type(err).__name__}: {err}"
    return {"raised": raised, "changed": differences(before, snapshot(model._forward_module, opt))}


def run_case(case: dict) -> dict:
    strategy = case["strategy"]
    if isinstance(strategy, dict):
        strategy = zero_strategy.ZeroFabricStrategy(**strategy)
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy,
                    precision=case.get("precision", "32-true"))
    fabric.launch()
    if case.get("refused"):
        return refused_strict_load(fabric, case)
    model, opt = build(fabric)
    losses: list[float] = []
    steps = case.get("steps", 3)
    train(fabric, model, opt, case, range(steps), losses)
    if case.get("save"):
        fabric.save(case["save"], {"model": model, "optimizer": opt, "step": steps})
        zero_strategy.teardown(model.module if hasattr(model, "module") else model._forward_module)
        model, opt = build(fabric)  # a fresh model and optimizer, then load
        state = {"model": model, "optimizer": opt, "step": 0}
        rest = fabric.load(case["save"], state)
        assert state["step"] == steps and rest == {}, (state["step"], rest)
        train(fabric, model, opt, case, range(steps, steps + case.get("extra", 2)), losses)
    module = model._forward_module if hasattr(model, "_forward_module") else model
    if hasattr(module, "module"):  # DDP
        module = module.module
    full = zero_strategy.full_state_dict(module) if case["strategy"] != "ddp" else {
        k: v.detach().float().clone() for k, v in module.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(case["save_dir"], f"{case['name']}.pt"))
    return {"losses": losses}


def main() -> None:
    args, out = start()
    finish(out, run_named_cases(args["cases"], lambda case: run_case(case)))


if __name__ == "__main__":
    main()
