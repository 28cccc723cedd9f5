"""DeepSpeed 0.19.8 checkpoints (made here, on CPU with gloo) resumed by zero_strategy.

args["mode"] == "deepspeed": for each case {name, stage, bf16, offload ("" | "optimizer" |
"optimizer+param"), dir, ds_optimizer (optional: the class name of DeepSpeed's own optimizer that
its config's AdamW must build, instead of the user's torch AdamW)}, DeepSpeed trains TinyLM for SAVE_AT steps, saves a checkpoint into
``dir``, and trains on to END; rank 0 writes ``dir/reference.pt``: the global loss of each step
after the save, the fp32 weights at the save (``safe_get_full_fp32_param``) and at the end, and the
frozen parameter (set to -2x its initial value before training, so a resume that did not load it
shows).

args["mode"] == "ours": for each case {name, stage, precision, dir}, zero_strategy sets up the same
model, loads ``dir`` (the DeepSpeed checkpoint) and trains steps [SAVE_AT, END). Reports the
global losses, the fp32 weights right after the load and at the end (rank 0, to ``<out>/<name>.pt``).

args["mode"] == "refused": for each case {name, stage, dir} (a damaged DeepSpeed checkpoint), train
one step, try the load; report the error message and every value that changed (tests/_refused_load.py).

Every step uses one global batch of GLOBAL samples; rank r of N takes its GLOBAL/N slice and the
loss is the mean over it, so the averaged gradient is the same at any world size.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

# [Note: DeepSpeed's compiled ops in the tests]
# DeepSpeed compiles its C++ ops on first use into torch's extension cache (~/.cache/torch_extensions/
# py311_cpu by default), one directory per op whatever Python environment built it; ninja rebuilds an
# op whose compile command changed, and the command names the environment's torch headers. So two
# environments on one machine (.ci/venv and .ci/venv-latest, or several checkouts) rebuilt
# DeepSpeedCPUAdam's op in turn: 1-6 minutes of both cores each time, at the head of this file's
# first test. Each environment keeps its own directory instead, so an op is built once per environment.
# And DeepSpeed's CPU communication backend builds a shared-memory op at initialize
# (deepspeed.comm.torch.build_shm_op) that only inference_all_reduce uses (tensor-parallel
# inference, deepspeed/module_inject): ZeRO training never calls it, so these runs skip its build.
if "TORCH_EXTENSIONS_DIR" not in os.environ:
    from torch.utils.cpp_extension import get_default_build_root
    env_tag = hashlib.sha1(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(get_default_build_root(), f"zero_strategy_tests-{env_tag}")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _models import SEQ, VOCAB, TinyLM, loss_fn, param_groups  # noqa: E402
from _worker import finish, run_cases, start  # noqa: E402

GLOBAL, SAVE_AT, END = 8, 3, 6


def global_batch(step: int):
    g = torch.Generator().manual_seed(9000 + step)
    return (torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g),
            torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=g))


def build(vocab: int = VOCAB):
    """``vocab`` (case["vocab"]): a larger one makes the embedding big enough for DeepSpeed to swap
    its optimizer state to NVMe (it keeps a sub-group under 1 MiB per rank in memory)."""
    torch.manual_seed(4321)
    model = TinyLM(layers=2, vocab=vocab)
    return model, torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))


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


def scheduler(optimizer):
    """The run's LR scheduler (``case["scheduler"]``): a decay every step, so a resume that did not
    restore it shows in the next step's loss."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))


def deepspeed_engine(case: dict, load_universal: bool = False):
    """DeepSpeed's engine over the run's model (its frozen parameter changed) for ``case``, and that
    frozen parameter's value (read before DeepSpeed partitions it at stage 3)."""
    import deepspeed

    # See [Note: DeepSpeed's compiled ops in the tests]. The module itself: the attribute
    # ``deepspeed.comm.torch`` is torch, which deepspeed.comm imports under that name
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    model, opt = build(case.get("vocab", VOCAB))
    with torch.no_grad():  # the frozen parameter differs from a fresh model's: the resume must load it
        model.frozen_mix.mul_(-2.0)
    frozen = model.frozen_mix.detach().clone()
    zero: dict = {"stage": case["stage"]}
    # offload "nvme-...": DeepSpeed swaps to files under case["nvme_path"] (a fresh folder per run)
    where = {"device": "nvme", "nvme_path": case["nvme_path"]} if case["offload"].startswith("nvme") else {"device": "cpu"}
    if "optimizer" in case["offload"]:
        zero["offload_optimizer"] = dict(where)
    if "param" in case["offload"]:
        zero["offload_param"] = dict(where)
    config = {"train_micro_batch_size_per_gpu": GLOBAL // dist.get_world_size(), "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_optimization": zero, "bf16": {"enabled": case["bf16"]},
              "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9,
              "checkpoint": {"load_universal": load_universal}}
    if case.get("ds_optimizer"):  # DeepSpeed's own: DeepSpeedCPUAdam where the optimizer is offloaded
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
        assert type(engine.optimizer.optimizer).__name__ == case["ds_optimizer"], type(engine.optimizer.optimizer)
    else:  # the user's torch.optim.AdamW (and LR scheduler: DeepSpeed steps it in engine.step())
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config,
                                               lr_scheduler=scheduler(opt) if case.get("scheduler") else None)
    return engine, frozen


def deepspeed_backward_step(engine):
    def backward_step(loss):
        engine.backward(loss)
        engine.step()
    return backward_step


def deepspeed_fp32_weights(engine) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()
            if p.requires_grad}


def run_deepspeed(case: dict) -> dict:
    engine, frozen = deepspeed_engine(case)
    backward_step, fp32_weights = deepspeed_backward_step(engine), lambda: deepspeed_fp32_weights(engine)
    for step in range(SAVE_AT):
        train_step(engine, step, backward_step)
    engine.save_checkpoint(case["dir"], client_state={"epoch": 7})
    at_save = fp32_weights()
    losses = [train_step(engine, step, backward_step) for step in range(SAVE_AT, END)]
    final = fp32_weights()
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "at_save": at_save, "final": final, "frozen": frozen,
                    "lr": [pg["lr"] for pg in engine.optimizer.param_groups]},
                   os.path.join(case["dir"], "reference.pt"))
    dist.barrier()
    return {"name": case["name"]}


def run_deepspeed_universal(case: dict, out) -> dict:
    """DeepSpeed resumes the universal checkpoint ``case["dir"]`` (``load_universal``) and trains on."""
    engine, _ = deepspeed_engine(case, load_universal=True)
    path, client = engine.load_checkpoint(case["dir"])
    assert path is not None, f"DeepSpeed loaded nothing from {case['dir']}"
    hyper = [{k: pg[k] for k in ("lr", "weight_decay")} for pg in engine.optimizer.param_groups]
    if case.get("set_hyper"):  # DeepSpeed's stage-3 universal load gives every group group 0's: set them again
        for pg, values in zip(engine.optimizer.param_groups, case["set_hyper"]):
            pg.update(values)
    if case.get("unshare_step"):  # ... and one step tensor to every sub-group, which each step then advances
        for st in engine.optimizer.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
    at_load = deepspeed_fp32_weights(engine)
    backward_step = deepspeed_backward_step(engine)
    losses = [train_step(engine, step, backward_step) for step in range(SAVE_AT, END)]
    final = deepspeed_fp32_weights(engine)
    if dist.get_rank() == 0:
        torch.save({"at_load": at_load, "final": final}, out / f"{case['name']}.pt")
    return {"name": case["name"], "losses": losses, "extra": {k: client[k] for k in ("epoch",) if k in client},
            "hyper": hyper}


def run_export(case: dict) -> dict:
    """zero_strategy resumes the DeepSpeed checkpoint ``dir``, saves it as ours (``ours``) and rank 0
    exports that as a DeepSpeed universal checkpoint (``universal``), as ``zero-strategy export`` does."""
    import zero_strategy as zs

    model, opt = build()
    model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=case["stage"], precision=case["precision"],
                                                     param_persistence_threshold=0))
    extra = zs.load_checkpoint(case["dir"], model, zopt)
    zs.save_checkpoint(case["ours"], model, zopt, extra_state=extra)
    if dist.get_rank() == 0:
        zs.checkpoint.export_checkpoint(case["ours"], case["universal"], format="deepspeed-universal")
    dist.barrier()
    return {"name": case["name"]}


def run_ours(case: dict, out) -> dict:
    import zero_strategy as zs

    model, opt = build(case.get("vocab", VOCAB))
    cfg = zs.ZeroConfig(stage=case["stage"], precision=case["precision"], param_persistence_threshold=0,
                        offload_optimizer=zs.CPUOffload() if case.get("offload") else None)
    model, zopt = zs.setup(model, opt, cfg)
    sched = scheduler(zopt.optimizer) if case.get("scheduler") else None
    extra = zs.load_checkpoint(case["dir"], model, zopt, lr_scheduler=sched)
    at_load = zs.full_state_dict(model, dtype=None)

    def backward_step(loss):
        zopt.backward(loss)
        zopt.step()
        if sched is not None:
            sched.step()
        zopt.zero_grad()

    losses = [train_step(model, step, backward_step) for step in range(SAVE_AT, END)]
    final = zs.full_state_dict(model, dtype=None)
    if dist.get_rank() == 0:
        torch.save({"at_load": at_load, "final": final}, out / f"{case['name']}.pt")
    return {"name": case["name"], "losses": losses, "extra": extra,
            "hyper": [{k: pg[k] for k in ("lr", "weight_decay", "betas")} for pg in zopt.optimizer.param_groups]}


def run_refused(case: dict) -> dict:
    """Train one step, try to load the damaged ``dir``: report the error and what changed (nothing)."""
    import zero_strategy as zs
    from _refused_load import differences, snapshot

    model, opt = build()
    model, zopt = zs.setup(model, opt, zs.ZeroConfig(stage=case["stage"], param_persistence_threshold=0))
    train_step(model, 0, lambda loss: (zopt.backward(loss), zopt.step(), zopt.zero_grad()))
    before = snapshot(model, zopt)
    try:
        zs.load_checkpoint(case["dir"], model, zopt)
        error = None
    except zs.CheckpointError as err:
        error = str(err)
    return {"name": case["name"], "error_message": error, "changed": differences(before, snapshot(model, zopt))}


def main() -> None:
    args, out = start()
    if args["mode"] == "deepspeed":
        results = run_cases(args["cases"], run_deepspeed, key="name")
    elif args["mode"] == "refused":
        results = run_cases(args["cases"], run_refused, key="name")
    elif args["mode"] == "export":
        results = run_cases(args["cases"], run_export, key="name")
    elif args["mode"] == "deepspeed_universal":
        results = run_cases(args["cases"], lambda case: run_deepspeed_universal(case, out), key="name")
    else:
        results = run_cases(args["cases"], lambda case: run_ours(case, out), key="name")
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
