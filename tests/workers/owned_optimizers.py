"""Optimizers that need whole tensors (the ownership layout) against DDP and one process.

args["cases"]: dicts with ``name``, ``recipe`` ("muon": torch's docs recipe, Muon for the 2-D
hidden matrices and AdamW for the rest as two optimizers; "adafactor": one Adafactor over
everything in two param groups; "adamw8bit": bitsandbytes' AdamW8bit over them), ``stage``,
``precision`` (fp32 | bf16), optionally ``clip`` (global-norm clipping in the config),
``offload_optimizer`` / ``offload_params`` ("cpu", "nvme" under ``nvme_path`` with staging slots
of ``buffer_size`` bytes), ``overlap_step`` and ``steps``; checkpoints: ``save_at`` (after that
many steps, into ``ckpt``), ``final`` (rank 0 saves the final full state dict there),
``load_from`` and ``start`` (resume that checkpoint, then train from step ``start``).

Three runs of the same optimizers from the same weights, per case (the two references once per
launch for all the cases they are the same for: :func:`reference`):

* zero_strategy, each rank its own batch;
* torch DDP (bf16: over a bf16 copy whose gradients step fp32 masters, the textbook recipe);
* one process on the global batch (both ranks' batches), fp32 (computed on every rank);

plus, for the Muon recipe, the single process with SGD-momentum in Muon's place, which a
ZeRO that silently skipped the orthogonalization (as DeepSpeed's Muon at stage 0 does)
would match. Each rank reports the relative differences (tests/_compare.py).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _compare import rel, rel_diff
from _models import TinyLM, batch, loss_fn, whole_tensor_recipe as optimizers
from _worker import finish, run_cases, start

import zero_strategy as zs


def clip_and_step(opts, clip):
    """ZeroConfig(gradient_clipping=...) clips each optimizer's gradients by their own global norm
    (a GAN's two optimizers each by theirs), so the references do the same."""
    for o in opts:
        if clip:
            torch.nn.utils.clip_grad_norm_([p for pg in o.param_groups for p in pg["params"]], clip)
    for o in opts:
        o.step()
        o.zero_grad()


def single_process(base, recipe, steps, world, clip):
    model = copy.deepcopy(base)
    opts = optimizers(model, recipe)
    for step in range(steps):
        pairs = [batch(r, step, 0) for r in range(world)]
        tokens = torch.cat([t for t, _ in pairs])
        targets = torch.cat([t for _, t in pairs])
        loss_fn(model(tokens), targets).backward()
        clip_and_step(opts, clip)
    return model.state_dict()


def ddp_run(base, recipe, steps, rank, precision, clip):
    master = copy.deepcopy(base)
    compute = copy.deepcopy(base).to(torch.bfloat16) if precision == "bf16" else master
    ddp = DDP(compute)
    opts = optimizers(master, recipe)
    losses = []
    for step in range(steps):
        tokens, targets = batch(rank, step, 0)
        loss = loss_fn(ddp(tokens), targets)
        loss.backward()
        losses.append(loss.item())
        if compute is not master:
            for pm, pc in zip(master.parameters(), compute.parameters()):
                if pc.grad is not None:
                    pm.grad, pc.grad = pc.grad.float(), None
        clip_and_step(opts, clip)
        if compute is not master:
            with torch.no_grad():
                for pm, pc in zip(master.parameters(), compute.parameters()):
                    pc.copy_(pm)
    sd = master.state_dict()
    if compute is not master:  # the frozen matrix is used (and kept) in bf16, as zero_strategy keeps it
        sd["frozen_mix"] = compute.frozen_mix.detach().float()
    return sd, losses


def _offload(value, case):
    """"nvme": NVMe offload under the case's nvme_path (a per-test temporary directory), staging
    slots of the case's ``buffer_size`` (default 16 KiB: a block's owned matrices fit one; 4096:
    none does, so an owned group steps in runs of whole parameters)."""
    if value == "nvme":
        return {"device": "nvme", "path": case["nvme_path"], "buffer_size": case.get("buffer_size", 4096 * 4)}
    return value


def zero_run(base, case, rank, steps):
    model = copy.deepcopy(base)
    cfg = zs.ZeroConfig(stage=case["stage"], precision=case["precision"], param_persistence_threshold=0,
                        gradient_clipping=case.get("clip"), offload_optimizer=_offload(case.get("offload_optimizer"), case),
                        offload_params=_offload(case.get("offload_params"), case),
                        overlap_step=case.get("overlap_step", False))
    model, zopts = zs.setup(model, optimizers(model, case["recipe"]), cfg)
    engine = zs.api._engine_of(model)
    owned = sorted(g.name for g in engine.groups if g.owned)
    on_host = any(g.masters.steps_on_host for g in engine.groups if g.owned)
    start = 0
    if case.get("load_from"):  # resume a checkpoint another world size and stage saved
        zs.load_checkpoint(case["load_from"], model, zopts)
        start = case["start"]
    losses = [None] * start
    for step in range(start, steps):
        tokens, targets = batch(rank, step, 0)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        losses.append(loss.item())
        for z in zopts:
            z.step()
        for z in zopts:
            z.zero_grad()
        if step + 1 == case.get("save_at"):
            zs.save_checkpoint(case["ckpt"], model, zopts)
    owned_state = sum(len(z.group_states(g)) for z in zopts for g in z.groups if g.owned)
    nvme = [g for g in engine.groups if g.owned and hasattr(g.masters, "swapped_state")]  # optimizer on NVMe
    # NVMe: how many per-parameter state tensors rest in the swap file, and whether a group stepped in runs
    nvme_state = dict(swapped=sum(len([k for k in g.masters.swapped_state() if k.startswith("p")]) for g in nvme),
                      in_runs=any(g.masters.streams for g in nvme))
    comm = zs.comm_stats(model)  # the last step's, before full_state_dict gathers more
    trainable = [g for g in engine.groups if g.trainable]
    volume = dict(reduce_scatter=comm.get("reduce_scatter", {}).get("volume_elements", 0),
                  all_gather=comm.get("all_gather", {}).get("volume_elements", 0),
                  padded=sum(g.padded_numel for g in trainable), real=sum(g.numel for g in trainable),
                  flat_padded=sum(-(-g.numel // g.world_size) * g.world_size for g in trainable))
    final = zs.full_state_dict(model)
    module_view = rel_diff(model.state_dict(), final)  # stage 3 gathers through the slots' offsets
    if case.get("final") and rank == 0:
        torch.save(final, case["final"])
    volume["state_dict_vs_full"] = module_view
    volume["nvme"] = nvme_state
    return final, losses, owned, owned_state, on_host, volume


#: the reference runs of this launch, by what they read of a case (see :func:`reference`)
_REFERENCES: dict[tuple, object] = {}


def reference(key: tuple, run):
    """``run()``, once per launch for all the cases whose reference ``key`` names the same run: the
    references read only the recipe, the steps, the precision (DDP) and the clipping of a case, not
    what only the zero_strategy side reads (stage, offload, slot size, overlap_step, checkpoints).
    Each is deterministic (the same base weights, batches and optimizers), so running it again for
    the next case gave the same result bit for bit; every rank runs the same cases in the same order,
    so the ranks agree on which DDP runs happen (its all-reduces stay in lock-step). As
    tests/workers/parity.py's ``reference_run``."""
    if key not in _REFERENCES:
        _REFERENCES[key] = run()
    return _REFERENCES[key]


def run(case: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    steps, recipe, clip = case.get("steps", 6), case["recipe"], case.get("clip")
    torch.manual_seed(1234)
    base = TinyLM(layers=3)  # the same weights for every case: the references' key leaves them out
    zero, zero_losses, owned, owned_state, on_host, volume = zero_run(base, case, rank, steps)
    ddp, ddp_losses = reference(("ddp", recipe, steps, case["precision"], clip),
                                lambda: ddp_run(base, recipe, steps, rank, case["precision"], clip))
    single = reference(("single", recipe, steps, clip), lambda: single_process(base, recipe, steps, world, clip))
    out = dict(name=case["name"], volume=volume, owned_groups=owned, owned_state_entries=owned_state, stepped_on_host=on_host,
               vs_ddp=rel_diff(zero, ddp), vs_single=rel_diff(zero, single), ddp_vs_single=rel_diff(ddp, single),
               loss_vs_ddp=max(rel(a, b) for a, b in zip(zero_losses, ddp_losses) if a is not None),
               moved=rel_diff(zero, base.state_dict()))
    if case["recipe"] == "muon":
        sgd = reference(("single", "sgd_in_muons_place", steps, clip),
                        lambda: single_process(base, "sgd_in_muons_place", steps, world, clip))
        out["vs_sgd_momentum"] = rel_diff(zero, sgd)
    return out


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run, key="name")})


if __name__ == "__main__":
    main()
