"""zero_strategy over a subgroup next to torch DDP over the same subgroup.

The world (4 ranks) is split into pairs [0, 1] and [2, 3]; each pair trains its own
data from its own starting weights (every rank builds the model from its own seed,
and setup, like DDP, must start the pair from the pair's first rank). A broadcast
that names a group rank where a global rank is meant, or a collective that runs over
the world instead of the pair, shows up as a pair that differs from its DDP.

args["cases"]: dicts with ``config`` (a preset name or ZeroConfig kwargs) and
optionally ``split`` ("new_group": dist.new_group per pair, the default;
"new_subgroups": dist.new_subgroups(2)), ``meta`` (build on the meta device, let
setup materialize), ``accum`` (micro-batches, all but the last under no_sync),
``clip`` (global-norm clipping), ``steps``, and ``checkpoint`` (a directory: each
pair saves into its own subdirectory, perturbs its weights and loads them back).
args["non_member"]: also check that a rank passing a group it is not in gets a
ValueError, and that the members of that group still train.

Reports per case: per-step losses of both, the largest relative weight difference
(per tensor: max|a-b| / max|ref|), whether the pair's two replicas hold identical
weights, and the pair's initial value of one weight (so the test can see the pairs
really started apart).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _worker import finish, run_cases, start, worst_rel_diff
from meta_init import init  # param_init_fn for a meta-device TinyLM
from _models import TinyLM, batch, loss_fn, param_groups

import zero_strategy as zs

PAIRS = ([0, 1], [2, 3])


def make_pairs(split: str):
    """This rank's subgroup, created collectively the way users do it."""
    if split == "new_subgroups":
        group, _ = dist.new_subgroups(group_size=2)
        return group
    groups = [dist.new_group(ranks) for ranks in PAIRS]  # every rank creates every group
    return groups[dist.get_rank() // 2]


def build(case: dict, group):
    """(zero model, zero optimizer, DDP reference over ``group``, its optimizer)."""
    torch.manual_seed(100 + dist.get_rank())  # every rank different: setup must sync from the pair's first rank
    cfg = case["config"] if isinstance(case["config"], str) else zs.ZeroConfig(**case["config"])
    if case.get("meta"):
        with torch.device("meta"):
            model = TinyLM(layers=3)
        model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95)), cfg,
                               process_group=group, param_init_fn=init)
        base = TinyLM(layers=3)
        base.load_state_dict(zs.full_state_dict(model))
    else:
        base = TinyLM(layers=3)
        model = copy.deepcopy(base)
        model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95)), cfg,
                               process_group=group)
    ref = DDP(base, process_group=group)
    return model, zopt, ref, torch.optim.AdamW(param_groups(ref.module), betas=(0.9, 0.95))


def run_case(case: dict) -> dict:
    rank = dist.get_rank()
    group = make_pairs(case.get("split", "new_group"))
    model, zopt, ref, ref_opt = build(case, group)
    start_weight = ref.module.embed.weight[0, 0].item()
    accum, clip = case.get("accum", 1), case.get("clip")
    losses_ref, losses_zero = [], []
    for step in range(case.get("steps", 3)):
        total_ref = total_zero = 0.0
        for micro in range(accum):
            tokens, targets = batch(rank, step, micro)
            last = micro == accum - 1
            with contextlib.nullcontext() if last else ref.no_sync():
                loss = loss_fn(ref(tokens), targets) / accum
                loss.backward()
            with contextlib.nullcontext() if last else zs.no_sync(model):
                lz = loss_fn(model(tokens), targets) / accum
                zopt.backward(lz)
            total_ref += loss.item()
            total_zero += lz.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            zopt.clip_grad_norm_(clip)
        ref_opt.step()
        ref_opt.zero_grad()
        zopt.step()
        zopt.zero_grad()
        losses_ref.append(total_ref)
        losses_zero.append(total_zero)
    full = zs.full_state_dict(model)
    worst, worst_name = worst_rel_diff(full, ref.module.state_dict())
    # replicas of one pair hold bit-identical weights, whatever the reference says
    flat = torch.cat([full[k].float().reshape(-1) for k in sorted(full)])
    replicas = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(replicas, flat, group=group)
    report = dict(case=case, losses_ref=losses_ref, losses_zero=losses_zero, weight_rel_diff=worst,
                  worst_tensor=worst_name, start_weight=start_weight,
                  pair_agrees=all(torch.equal(replicas[0], r) for r in replicas),
                  group_rank=dist.get_rank(group), group_size=dist.get_world_size(group))
    if case.get("checkpoint"):
        report.update(checkpoint_roundtrip(model, zopt, case["checkpoint"], rank))
    zs.teardown(model, keep_weights=False)
    return report


def checkpoint_roundtrip(model, zopt, root: str, rank: int) -> dict:
    """Each pair saves into its own directory, perturbs, reloads, and must get its own weights back."""
    path = f"{root}/pair{rank // 2}"
    before = {k: v.clone() for k, v in zs.full_state_dict(model).items()}
    zs.save_checkpoint(path, model, zopt)
    with zs.gathered_parameters(model, modifier_rank=0):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    zs.load_checkpoint(path, model, zopt)
    after = zs.full_state_dict(model)
    restored = max((after[k].float() - v.float()).abs().max().item() for k, v in before.items())
    return dict(checkpoint_restored_max_abs=restored)


def non_member_check() -> dict:
    """Rank 3 passes a group of ranks [0, 1]; ranks 0-1 set up over it and must train normally."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    torch.manual_seed(7)
    model = TinyLM(layers=2)
    opt = torch.optim.AdamW(model.parameters())
    out: dict = {}
    if rank == 3:
        try:
            zs.setup(model, opt, "zero3", process_group=group)
            out["non_member_error"] = None
        except ValueError as err:
            out["non_member_error"] = str(err)
    elif rank in (0, 1):
        model, zopt = zs.setup(model, opt, "zero3", process_group=group)
        tokens, targets = batch(rank, 0, 0)
        zopt.backward(loss_fn(model(tokens), targets))
        zopt.step()
        out["member_ok"] = True
    return out


def main() -> None:
    args, out = start()
    report: dict = {"results": run_cases(args["cases"], run_case)}
    if args.get("non_member"):
        try:
            report.update(non_member_check())
        except Exception:
            report["non_member_crash"] = traceback.format_exc()
            print(traceback.format_exc(), file=sys.stderr)
    finish(out, report)


if __name__ == "__main__":
    main()
