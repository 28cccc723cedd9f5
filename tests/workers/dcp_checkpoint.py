"""FSDP2 runs and zero_strategy runs moving into each other through torch.distributed.checkpoint (DCP).

Every step uses one global batch of GLOBAL samples; rank r of N takes its GLOBAL/N slice and the
loss is the mean over it, so the averaged gradient is the same at any world size. The model is
TinyLM (tied weights, a frozen parameter set to -2x its initial value before training so a resume
that did not load it shows, a 1-element parameter) with torch AdamW over two param groups.

args["mode"] == "fsdp": for each case {name, dirs: {layout: dir}}, FSDP2 (``fully_shard`` per
block and at the root) trains SAVE_AT steps, saves a DCP checkpoint into each dir in its layout
("nested": ``dcp.save({"model": ..., "optim": ...})`` of ``get_state_dict``, as the PyTorch
tutorials write it; "torchtitan": the model's entries at the top level and the optimizer's
flattened under ``optimizer``, as torchtitan writes them), and trains on to END. Rank 0 writes
``<dir>/../reference.pt``: the global losses after the save, the weights at the save and at the end.

args["mode"] == "ours": for each case {name, stage, dir, offload (optional: "cpu" or "nvme"), nvme_path},
zero_strategy sets up the same model, loads ``dir`` (DCP) and trains [SAVE_AT, END); reports the
losses, the hyperparameters and how many elements of saved chunks the rank read (DCP's
``FileSystemReader.read_data`` counted), and rank 0 writes the weights right after the load and
at the end to ``<out>/<name>.pt``.

args["mode"] == "ours_save": for each case {name, stage, dir, dcp, live}, zero_strategy trains SAVE_AT
steps, saves its own checkpoint into ``dir``, rank 0 exports it to DCP at ``dcp``
(``export_checkpoint``), every rank writes its live shards as DCP at ``live`` (``save_dcp``), and it
trains on to END; rank 0 writes the reference as in "fsdp".

args["mode"] == "refused": for each case {name, stage, dir} (a damaged DCP checkpoint), train one step,
try the load; report the error message and every value that changed (tests/_refused_load.py).

args["mode"] == "fsdp_resume": for each case {name, dir}, FSDP2 loads the DCP ``dir`` the way the
PyTorch tutorial does (``get_state_dict``, ``dcp.load``, ``set_state_dict``) and trains [SAVE_AT, END).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from _models import SEQ, VOCAB, TinyLM, loss_fn, param_groups
from _worker import finish, run_cases, start

GLOBAL, SAVE_AT, END = 8, 3, 6


def global_batch(step: int):
    g = torch.Generator().manual_seed(7000 + step)
    return (torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g),
            torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g))


def build():
    torch.manual_seed(1234)
    model = TinyLM(layers=2)
    with torch.no_grad():  # the frozen parameter differs from a fresh model's: a resume must load it
        model.frozen_mix.mul_(-2.0)
    return model


def adamw(model):
    return torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))


def train_step(model, step: int, backward_step) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = global_batch(step)
    per = GLOBAL // world
    sl = slice(rank * per, (rank + 1) * per)
    loss = loss_fn(model(tokens[sl]), targets[sl])
    backward_step(loss)
    total = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / world


# ------------------------------------------------------------------ FSDP2
def fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def fsdp_step(opt):
    def backward_step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()
    return backward_step


def full_weights(model) -> dict:
    """Every parameter whole (FSDP2: gathered from its DTensor shards) under each of its names, on every rank."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)}


def save_fsdp(model, opt, layout: str, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if layout == "nested":
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    else:  # torchtitan's CheckpointManager: the model flattened to the top level, the optimizer flattened
        model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({**model_sd, "optimizer": optim_sd, "train_state": {"step": torch.tensor(SAVE_AT)}},
                 checkpoint_id=path)


def run_fsdp(case: dict) -> dict:
    model = fsdp2(build())
    opt = adamw(model)
    for step in range(SAVE_AT):
        train_step(model, step, fsdp_step(opt))
    for layout, path in case["dirs"].items():
        save_fsdp(model, opt, layout, path)
    at_save = full_weights(model)
    losses = [train_step(model, step, fsdp_step(opt)) for step in range(SAVE_AT, END)]
    final = full_weights(model)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "at_save": at_save, "final": final},
                   Path(next(iter(case["dirs"].values()))).parent / "reference.pt")
    dist.barrier()
    return {"name": case["name"]}


def run_fsdp_resume(case: dict, out: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(99)  # weights unlike the saved run's: the load must bring them all
    model = fsdp2(TinyLM(layers=2))
    opt = adamw(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=case["dir"])
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    at_load = full_weights(model)
    losses = [train_step(model, step, fsdp_step(opt)) for step in range(SAVE_AT, END)]
    final = full_weights(model)
    if dist.get_rank() == 0:
        torch.save({"at_load": at_load, "final": final}, out / f"{case['name']}.pt")
    return {"name": case["name"], "losses": losses,
            "hyper": [{k: pg[k] for k in ("lr", "weight_decay")} for pg in opt.param_groups]}


# ------------------------------------------------------------------ zero_strategy
def setup_ours(stage: int, offload: str | None = None, nvme_path: str | None = None):
    """``offload``: None, "cpu" (the optimizer), or "nvme" (optimizer and parameters, in ``nvme_path``)."""
    import zero_strategy as zs

    model = build()
    kw: dict = {}
    if offload == "cpu":
        kw = dict(offload_optimizer=zs.CPUOffload())
    elif offload == "nvme":
        nvme = zs.NVMeOffload(path=nvme_path)
        kw = dict(offload_optimizer=nvme, offload_params=nvme)
    return zs.setup(model, adamw(model), zs.ZeroConfig(stage=stage, precision="fp32", param_persistence_threshold=0,
                                                       **kw))


class ChunkReads:
    """The chunks this rank reads (``FileSystemReader.read_data``, DCP's own reader, patched to count)."""

    def __init__(self):
        from torch.distributed.checkpoint import FileSystemReader

        self.chunks: set[tuple] = set()
        original = FileSystemReader.read_data

        def read_data(reader, plan, planner):
            self.chunks.update((item.storage_index.fqn, tuple(item.storage_index.offset), tuple(item.lengths))
                               for item in plan.items if item.storage_index.offset is not None)
            return original(reader, plan, planner)
        FileSystemReader.read_data = read_data
        self._restore = lambda: setattr(FileSystemReader, "read_data", original)

    def elements(self) -> int:
        return sum(math.prod(sizes) for _, _, sizes in self.chunks)

    def close(self) -> None:
        self._restore()


def ours_step(zopt):
    def backward_step(loss):
        zopt.backward(loss)
        zopt.step()
        zopt.zero_grad()
    return backward_step


def run_ours(case: dict, out: Path) -> dict:
    import zero_strategy as zs

    torch.manual_seed(99)
    model, zopt = setup_ours(case["stage"], case.get("offload"), case.get("nvme_path"))
    reads = ChunkReads()
    try:
        extra = zs.load_checkpoint(case["dir"], model, zopt)
    finally:
        reads.close()
    at_load = zs.full_state_dict(model, dtype=None)
    losses = [train_step(model, step, ours_step(zopt)) for step in range(SAVE_AT, END)]
    final = zs.full_state_dict(model, dtype=None)
    if dist.get_rank() == 0:
        torch.save({"at_load": at_load, "final": final}, out / f"{case['name']}.pt")
    return {"name": case["name"], "losses": losses, "extra": extra, "read_elements": reads.elements(),
            "hyper": [{k: pg[k] for k in ("lr", "weight_decay", "betas")} for pg in zopt.optimizer.param_groups]}


def run_refused(case: dict) -> dict:
    """Train one step, try to load the damaged DCP ``dir``: report the error and what changed (nothing)."""
    import zero_strategy as zs
    from _refused_load import differences, snapshot

    model, zopt = setup_ours(case["stage"])
    train_step(model, 0, ours_step(zopt))
    before = snapshot(model, zopt)
    try:
        zs.load_checkpoint(case["dir"], model, zopt)
        error = None
    except zs.CheckpointError as err:
        error = str(err)
    return {"name": case["name"], "error_message": error, "changed": differences(before, snapshot(model, zopt))}


def run_ours_save(case: dict) -> dict:
    import zero_strategy as zs

    model, zopt = setup_ours(case["stage"])
    for step in range(SAVE_AT):
        train_step(model, step, ours_step(zopt))
    zs.save_checkpoint(case["dir"], model, zopt)
    if dist.get_rank() == 0:
        zs.checkpoint.export_checkpoint(case["dir"], case["dcp"], format="dcp")
    dist.barrier()
    zs.checkpoint.save_dcp(case["live"], model, zopt)
    at_save = zs.full_state_dict(model, dtype=None)
    losses = [train_step(model, step, ours_step(zopt)) for step in range(SAVE_AT, END)]
    final = zs.full_state_dict(model, dtype=None)
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "at_save": at_save, "final": final}, Path(case["dcp"]).parent / "reference.pt")
    return {"name": case["name"]}


def main() -> None:
    args, out = start()
    mode = args["mode"]
    run = {"fsdp": run_fsdp, "ours_save": run_ours_save, "refused": run_refused,
           "ours": lambda case: run_ours(case, out), "fsdp_resume": lambda case: run_fsdp_resume(case, out)}[mode]
    finish(out, {"results": run_cases(args["cases"], run, key="name")})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
