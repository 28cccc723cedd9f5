"""ZeroAccelerator vs plain Accelerate DDP, and save_state -> load_state, under ``accelerate launch``.

Modes (args.json ``mode``):

* ``launch`` (N processes, the shipped CPU config): for each preset, train the same
  model copy with a ZeroAccelerator and with a plain ``Accelerator`` (DDP) through
  prepared data loaders, ``accumulate``, ``backward``, ``clip_grad_norm_`` and an LR
  scheduler, and report the largest relative weight difference. Then the resume
  scenario: train ``k`` steps, ``save_state``, train to ``n`` (the reference), and
  resume from the checkpoint into a fresh model under another preset.
* ``resume`` (one process, plain ``python``): load the checkpoint the launch saved and
  finish the run; it must land on the reference weights.

Each rank writes ``rank<r>.json``; the test judges those reports.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _models import SEQ, VOCAB, TinyLM, param_groups  # noqa: E402
from _compare import rel_diff  # noqa: E402
from _worker import finish  # noqa: E402

import zero_strategy as zs  # noqa: E402
from zero_strategy.accelerate import ZeroAccelerator  # noqa: E402

GLOBAL_ROWS = 8  # rows per micro-batch over all processes (divisible by 1, 2 and 4)


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train_with_loader(acc, model, data, gas: int, clip: float):
    """The ordinary Accelerate loop; returns the grad norms clip_grad_norm_ returned."""
    opt = torch.optim.AdamW(param_groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_ROWS // acc.num_processes, shuffle=False)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    acc.prepared_model_type = type(model).__name__
    norms = []
    for tokens in loader:
        with acc.accumulate(model):
            acc.backward(loss_of(model, tokens))
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), clip)))
            opt.step()
            sched.step()
            opt.zero_grad()
    return norms


def full_weights(acc, model) -> dict:
    if getattr(acc, "is_zero_model", lambda m: False)(model):
        return zs.full_state_dict(model)
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


# ---------------------------------------------------------------- resume scenario
def global_batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (GLOBAL_ROWS, SEQ + 1), generator=g)


def my_rows(acc, tokens):
    n = GLOBAL_ROWS // acc.num_processes
    return tokens[acc.process_index * n:(acc.process_index + 1) * n]


def build(acc, seed: int):
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(param_groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))
    return acc.prepare(model, opt, sched)


def run_steps(acc, model, opt, sched, first: int, last: int, gas: int, clip: float) -> None:
    for step in range(first, last):
        for micro in range(gas):
            with acc.accumulate(model):
                acc.backward(loss_of(model, my_rows(acc, global_batch(step, micro))))
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                if acc.sync_gradients:
                    sched.step()
                opt.zero_grad()


def new_accelerator(preset, gas):
    # step_scheduler_with_optimizer=False: Accelerate would otherwise step the schedule once per
    # process, which makes the schedule depend on the process count we resume on
    return ZeroAccelerator(preset, gradient_accumulation_steps=gas, step_scheduler_with_optimizer=False)


def launch_mode(args: dict, out: Path) -> dict:
    from accelerate import Accelerator

    gas, clip = args["gas"], args["clip"]
    first = ZeroAccelerator(args["presets"][0], gradient_accumulation_steps=gas)
    reference = Accelerator(gradient_accumulation_steps=gas)  # plain DDP, same (CPU, gloo) state
    report = {"distributed_type": str(first.distributed_type), "num_processes": first.num_processes,
              "parity": {}}
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, VOCAB, (GLOBAL_ROWS * gas * args["steps"], SEQ + 1), generator=g)
    for i, preset in enumerate(args["presets"]):
        acc = first if i == 0 else ZeroAccelerator(preset, gradient_accumulation_steps=gas)
        torch.manual_seed(0)
        model = TinyLM()
        ref_model = copy.deepcopy(model)
        norms = train_with_loader(acc, model, data, gas, clip)
        ref_norms = train_with_loader(reference, ref_model, data, gas, clip)
        report["ref_model_type"] = reference.prepared_model_type
        report["zero_model_type"] = acc.prepared_model_type
        report["parity"][preset] = {
            "stage": acc.zero_config.stage, "same_object": acc.unwrap_model(model) is model,
            "rel": rel_diff(full_weights(acc, model), full_weights(reference, ref_model)),
            "norms": norms, "ref_norms": ref_norms, "clipped": any(n > clip for n in ref_norms)}

    # save_state at step k, continue to n; then resume a fresh model under another preset
    k, n = args["resume_at"], args["steps"]
    acc = new_accelerator(args["resume_save_preset"], gas)
    model, opt, sched = build(acc, seed=0)
    run_steps(acc, model, opt, sched, 0, k, gas, clip)
    ckpt = out / "state"
    acc.save_state(str(ckpt))
    report["background_saves"] = zs.api._engine_of(model).background_save.started  # async_save in the config
    at_k = full_weights(acc, model)
    run_steps(acc, model, opt, sched, k, n, gas, clip)
    at_n = full_weights(acc, model)
    if acc.is_main_process:
        torch.save({"at_k": at_k, "at_n": at_n}, out / "reference.pt")
    acc2 = new_accelerator(args["resume_load_preset"], gas)
    model2, opt2, sched2 = build(acc2, seed=123)  # other initial weights: load_state must replace them
    acc2.load_state(str(ckpt))
    report["resume_loaded_rel"] = rel_diff(full_weights(acc2, model2), at_k)
    report["resume_lr"] = [pg["lr"] for pg in opt2.param_groups]
    run_steps(acc2, model2, opt2, sched2, k, n, gas, clip)
    report["resume_final_rel"] = rel_diff(full_weights(acc2, model2), at_n)
    report["ckpt_files"] = sorted(os.listdir(ckpt))
    report["zero_files"] = sorted(os.listdir(ckpt / "zero_model"))
    return report


def resume_mode(args: dict, out: Path) -> dict:
    gas, clip = args["gas"], args["clip"]
    acc = new_accelerator(args["resume_load_preset"], gas)
    model, opt, sched = build(acc, seed=321)
    src = Path(args["from"])
    acc.load_state(str(src / "state"))
    ref = torch.load(src / "reference.pt")
    report = {"num_processes": acc.num_processes,
              "resume_loaded_rel": rel_diff(full_weights(acc, model), ref["at_k"])}
    run_steps(acc, model, opt, sched, args["resume_at"], args["steps"], gas, clip)
    report["resume_final_rel"] = rel_diff(full_weights(acc, model), ref["at_n"])
    return report


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    report = launch_mode(args, out) if args["mode"] == "launch" else resume_mode(args, out)
    finish(out, report)


if __name__ == "__main__":
    main()
