"""Train the TinyLM eagerly and compiled under zero_strategy, beside torch DDP.

args["cases"]: dicts with stage, precision, compile ("model": ``torch.compile(model)``
after setup; "blocks": ``block.compile()`` per unit after setup, torchtitan-style;
"blocks_before": ``model.layers[i] = torch.compile(block)`` before setup), offload
("cpu" | "nvme" | None; stage 3 offloads the parameter shards too), backend, steps.

Per case the three runs (DDP reference, eager zero, compiled zero) see the same data
and the same initial weights; reports their per-step losses and the largest relative
difference of the final full weights (per tensor: max|a-b| / max|ref|).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from _models import TinyLM, batch, loss_fn, param_groups
from _worker import finish, run_cases, start, worst_rel_diff
from parity import Reference, make_optimizer

import zero_strategy as zs


def _config(case: dict, nvme_path: str) -> zs.ZeroConfig:
    offload = case.get("offload")
    if offload == "nvme":
        offload = {"device": "nvme", "path": nvme_path, "buffer_size": 4096 * 4}
    return zs.ZeroConfig(stage=case["stage"], precision=case["precision"], param_persistence_threshold=0,
                         offload_optimizer=offload, offload_params=offload if case["stage"] == 3 else None)


def _compile_before_setup(model, case):
    if case.get("compile") == "blocks_before":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=case["backend"], fullgraph=True)
    return model


def _compile_after_setup(model, case):
    kind = case.get("compile")
    if kind == "model":
        return torch.compile(model, backend=case["backend"])
    if kind == "blocks":
        for block in model.layers:
            block.compile(backend=case["backend"], fullgraph=True)
    return model


def _train_zero(base, case, nvme_path):
    rank = dist.get_rank()
    model = _compile_before_setup(copy.deepcopy(base), case)
    opt = make_optimizer("adamw", param_groups(model))
    model, zopt = zs.setup(model, opt, _config(case, nvme_path))
    sched = torch.optim.lr_scheduler.LambdaLR(zopt, lambda s: 1.0 / (1 + s))  # as the Reference's
    run = _compile_after_setup(model, case)
    losses = []
    for step in range(case.get("steps", 3)):
        tokens, targets = batch(rank, step, 0)
        loss = loss_fn(run(tokens), targets)
        zopt.backward(loss)
        zopt.step()
        zopt.zero_grad()
        sched.step()
        losses.append(loss.item())
    full = {k.replace("_orig_mod.", ""): v for k, v in zs.full_state_dict(model).items()}
    zs.teardown(model)
    return losses, full


def _train_reference(base, case):
    rank = dist.get_rank()
    ref = Reference(base, dict(case, optimizer="adamw"))
    losses = []
    for step in range(case.get("steps", 3)):
        tokens, targets = batch(rank, step, 0)
        losses.append(ref.micro_step(tokens, targets, 1, True))
        ref.step(clip=None)
    return losses, ref.full_state_dict()


def run_case(case: dict, nvme_path: str) -> dict:
    torch.manual_seed(1234)
    base = TinyLM(layers=2)
    losses_ref, ref_sd = _train_reference(base, case)
    eager_case = dict(case, compile=None)
    losses_eager, eager_sd = _train_zero(base, eager_case, nvme_path)
    torch._dynamo.reset()
    counters.clear()
    losses_compiled, compiled_sd = _train_zero(base, case, nvme_path)
    graphs = counters["stats"]["unique_graphs"]  # 0 would mean nothing was compiled: parity by default
    vs_eager, name_eager = worst_rel_diff(compiled_sd, eager_sd)
    vs_ref, name_ref = worst_rel_diff(compiled_sd, ref_sd)
    return dict(case=case, losses_ref=losses_ref, losses_eager=losses_eager, losses_compiled=losses_compiled,
                vs_eager=vs_eager, worst_vs_eager=name_eager, vs_ref=vs_ref, worst_vs_ref=name_ref, graphs=graphs)


def main() -> None:
    args, out = start()
    results = run_cases(args["cases"], lambda case: run_case(case, args["nvme_path"]))
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
