"""A directory Lightning Fabric's ``DeepSpeedStrategy`` saved, loaded by ``fabric.load(path, state)``
with ``Fabric(strategy="zero2"/"zero3")`` and trained on, against DeepSpeed continuing its own run.

Fabric's DeepSpeedStrategy needs CUDA, so the directory is made the way its ``save_checkpoint``
makes one (lightning/fabric/strategies/deepspeed.py): of the state ``{"model": engine,
"optimizer": optimizer, "step": ..., "scheduler": scheduler}`` the engine and its optimizer go to
DeepSpeed's ZeRO files, and the rest, stateful objects as their ``state_dict()``, is the
``client_state`` of ``engine.save_checkpoint(dir, client_state=..., tag="checkpoint")``.

args["mode"] == "deepspeed": for each case {name, stage, dir}, DeepSpeed trains SAVE_AT steps (the
LR scheduler stepped by the loop, as Fabric's user steps it), saves as above, trains on to END;
rank 0 writes ``dir/reference.pt``: the global losses after the save, the fp32 weights at the end,
each group's lr at the end.
args["mode"] == "ours": for each case {name, strategy, dir}, a fresh model and optimizer set up by
``Fabric(strategy=...)``, ``fabric.load(dir, state)`` as Fabric's docs write it, then steps
[state["step"], END); reports the losses, the restored step, what ``fabric.load`` returned and each
group's lr at the end; rank 0 saves the final fp32 weights to ``<out>/<name>.pt``. A case with
"absent" instead loads a state with a key the client_state lacks and reports the error and every
value that changed (tests/_refused_load.py).
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist

import deepspeed_checkpoint as ds_worker  # noqa: F401 - sets DeepSpeed's CPU accelerator and op cache first
from _worker import finish, run_cases, start

import zero_strategy  # noqa: F401 - registers the presets

SAVE_AT, END = ds_worker.SAVE_AT, ds_worker.END


def run_deepspeed(case: dict) -> dict:
    import deepspeed

    # See [Note: DeepSpeed's compiled ops in the tests] in deepspeed_checkpoint.py
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    model, opt = ds_worker.build()
    with torch.no_grad():  # a frozen parameter unlike a fresh model's: the load must restore it
        model.frozen_mix.mul_(-2.0)
    config = {"train_micro_batch_size_per_gpu": ds_worker.GLOBAL // dist.get_world_size(),
              "gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "zero_optimization": {"stage": case["stage"]},
              "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    sched = ds_worker.scheduler(opt)

    def backward_step(loss):
        engine.backward(loss)
        engine.step()
        sched.step()

    for step in range(SAVE_AT):
        ds_worker.train_step(engine, step, backward_step)
    # Fabric's DeepSpeedStrategy.save_checkpoint(dir, {"model": engine, "optimizer": opt, "step": SAVE_AT,
    # "scheduler": sched}): everything but the engine and its optimizer, stateful objects as state dicts
    engine.save_checkpoint(case["dir"], client_state={"step": SAVE_AT, "scheduler": sched.state_dict()},
                           tag="checkpoint")
    losses = [ds_worker.train_step(engine, step, backward_step) for step in range(SAVE_AT, END)]
    final = ds_worker.deepspeed_fp32_weights(engine)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "final": final, "lr": [pg["lr"] for pg in engine.optimizer.param_groups]},
                   os.path.join(case["dir"], "reference.pt"))
    dist.barrier()
    return {"name": case["name"]}


def run_ours(case: dict, out) -> dict:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=case["strategy"])
    fabric.launch()
    model, optimizer = ds_worker.build()
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = ds_worker.scheduler(optimizer.optimizer.optimizer)  # over the torch AdamW the ZeroOptimizer steps

    state = {"model": model, "optimizer": optimizer, "step": 0, "scheduler": scheduler}
    if case.get("absent"):
        return {"name": case["name"], **refused_strict_load(fabric, case, state)}
    remainder = fabric.load(case["dir"], state)

    def backward_step(loss):
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    losses = [ds_worker.train_step(model, step, backward_step) for step in range(state["step"], END)]
    final = zero_strategy.full_state_dict(model._forward_module, dtype=None)
    if dist.get_rank() == 0:
        torch.save({"final": final}, out / f"{case['name']}.pt")
    return {"name": case["name"], "losses": losses, "step": state["step"], "remainder": sorted(remainder),
            "lr": [pg["lr"] for pg in optimizer.param_groups]}


def refused_strict_load(fabric, case: dict, state: dict) -> dict:
    """``fabric.load`` of a state with a key the client_state lacks (strict): Fabric's KeyError, and
    nothing of the checkpoint loaded before it."""
    from _refused_load import differences, snapshot

    model, optimizer = state["model"], state["optimizer"]
    before = snapshot(model._forward_module, optimizer)
    try:
        fabric.load(case["dir"], {**state, "absent": 1})
        raised = None
    except Exception as err:  # noqa: BLE001 - reported to the test
        raised = f"{type(err).__name__}: {err}"
    return {"raised": raised, "changed": differences(before, snapshot(model._forward_module, optimizer)),
            "step": state["step"]}


def main() -> None:
    args, out = start()
    if args["mode"] == "deepspeed":
        results = run_cases(args["cases"], run_deepspeed, key="name")
    else:
        results = run_cases(args["cases"], lambda case: run_ours(case, out), key="name")
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
