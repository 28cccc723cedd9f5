"""Train models whose ranks use different parameters with zero_strategy and a plain reference.

args["cases"]: dicts with model ("moe" | "moe_blocks" | "vlm" | "adapter" | "early_exit"),
routing ("disjoint" | "shared", the MoEs), images_on / text_only_steps (vlm), adapter_steps,
optimizer ("sgd", "adafactor"; default AdamW), unfreeze (a submodule frozen at setup and unfrozen after),
clear ("model": ``model.zero_grad()`` after each step, default the optimizer's), stage,
offload (None | "cpu"), precision, steps. The reference is a plain copy of the model trained
on the global batch on every rank (each rank's batch run through it, the losses averaged):
what DDP with ``find_unused_parameters=True`` computes. Reports per case the losses of both
and the largest relative difference of the final full weights. With ``grads_like_ddp``, also
which parameters have a ``.grad`` after each backward, beside a DDP copy with
``find_unused_parameters=True`` run on the same batches.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist

from _models import TinyLM
from _models import batch as lm_batch
from _routed_models import AdapterLM, MoEBlocksLM, RoutedMoELM, TinyVLM, routed_batch, vlm_batch
from _worker import finish, run_cases, start, worst_rel_diff

import zero_strategy as zs


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(7)
    return {"moe": RoutedMoELM, "moe_blocks": MoEBlocksLM, "vlm": TinyVLM, "adapter": AdapterLM,
            "early_exit": lambda: TinyLM(layers=3)}[kind]()


def batches(case: dict, rank: int, step: int):
    """(inputs as kwargs, targets) of ``rank`` at ``step``."""
    if case["model"] in ("moe", "moe_blocks"):
        tokens, hint, targets = routed_batch(rank, step, case.get("routing", "disjoint"))
        return dict(tokens=tokens, hint=hint), targets
    if case["model"] == "vlm":  # text_only_steps: no rank has images (a text-only batch of a mixed dataset)
        images_on = () if step in case.get("text_only_steps", ()) else tuple(case.get("images_on", (0,)))
        tokens, pixels, targets = vlm_batch(rank, step, images_on)
        return dict(tokens=tokens, pixel_values=pixels), targets
    if case["model"] == "adapter":  # every rank runs the adapters at adapter_steps only
        tokens, _, targets = routed_batch(rank, step)
        return dict(tokens=tokens, use_adapter=step in case["adapter_steps"]), targets
    tokens, targets = lm_batch(rank, step, 0)
    return dict(tokens=tokens, depth=None if rank == 0 else 2), targets  # rank 1 exits after 2 blocks


def make_optimizer(case: dict, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW (state per element and a step count), or SGD with momentum (state per element only);
    both with weight decay, so a parameter stepped without a gradient moves."""
    if case.get("optimizer") == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    if case.get("optimizer") == "adafactor":  # whole parameters, each with its own step count
        return torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.1)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def loss_of(model, inputs, targets):
    logits = model(**inputs)
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def run(case: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    base = build(case["model"])
    ref = copy.deepcopy(base)
    ref_opt = make_optimizer(case, ref)
    model = copy.deepcopy(base)
    if case.get("unfreeze"):  # frozen when set up, unfrozen after: refused on every rank at the step
        model.get_submodule(case["unfreeze"]).requires_grad_(False)
    opt = make_optimizer(case, model)
    cfg = zs.ZeroConfig(stage=case["stage"], precision=case.get("precision", "fp32"),
                        param_persistence_threshold=0, offload_optimizer=case.get("offload"),
                        offload_params=case.get("offload") if case["stage"] == 3 else None,
                        collective_timeout=case.get("timeout", 20.0))
    model, zopt = zs.setup(model, opt, cfg)
    if case.get("unfreeze"):
        model.get_submodule(case["unfreeze"]).requires_grad_(True)
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    ddp = None
    if case.get("grads_like_ddp"):
        ddp_model = copy.deepcopy(base)
        ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, find_unused_parameters=True)
        ddp_opt = make_optimizer(case, ddp_model)
    losses_ref, losses_zero, grads_zero, grads_ddp = [], [], [], []
    for step in range(case.get("steps", 4)):
        total = sum(loss_of(ref, *batches(case, r, step)) for r in range(world)) / world
        total.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses_ref.append(total.item())
        loss = loss_of(model, *batches(case, rank, step))
        loss.backward()
        grads_zero.append(sorted(n for n, p in model.named_parameters() if p.grad is not None))
        zopt.step()
        if case.get("clear") == "model":
            model.zero_grad()  # the habit of many loops: it must reach gradients other ranks brought
        else:
            zopt.zero_grad()
        losses_zero.append(loss.item())
        if ddp is not None:
            loss_of(ddp, *batches(case, rank, step)).backward()
            grads_ddp.append(sorted(n.removeprefix("module.") for n, p in ddp.named_parameters()
                                    if p.grad is not None))
            ddp_opt.step()
            ddp_opt.zero_grad()
    caught.__exit__(None, None, None)
    worst, name = worst_rel_diff(zs.full_state_dict(model), ref.state_dict())
    zs.teardown(model)
    return dict(case=case, losses_ref=losses_ref, losses_zero=losses_zero, weight_rel_diff=worst, worst=name,
                grads_zero=grads_zero, grads_ddp=grads_ddp,
                warnings=[str(w.message) for w in seen if "zero_strategy" in str(w.message)])


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run)})


if __name__ == "__main__":
    main()
