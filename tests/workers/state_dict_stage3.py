"""``model.state_dict()`` on a set-up model, the way users call it, against torch DDP.

args["cases"]: list of {"name", "config"} (a ZeroConfig dict or a preset with overrides).
Per case, the TinyLM trains 3 steps under DDP and under zero_strategy on the same data,
then on every rank:

* ``model.state_dict()`` and the DDP module's ``state_dict()``: keys in order, shapes,
  largest relative difference, smallest entry, and whether the tied head/embedding come
  out as one tensor (they do on a plain model, and ``save_pretrained`` relies on it);
* submodules: a block (a unit), a layer inside a block, the tied head (a root leaf);
* how often each unit was gathered by ``model.state_dict()``, and which units are still
  gathered afterwards (the engine's units);
* a state dict taken inside ``gathered_parameters`` and read after the block;
* one more training step: losses and weights still equal DDP's.
"""

from __future__ import annotations

import copy
import sys
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _compare import tensor_rel_diff
from _worker import finish, start
from _models import TinyLM, batch, loss_fn, param_groups

import zero_strategy as zs


def compare(got: dict, want: dict) -> dict:
    """Keys (in order), shapes, largest relative difference and the smallest entry of ``got``."""
    worst = 0.0
    for k, w in want.items():
        g = got.get(k)
        if g is None or g.shape != w.shape or g.numel() == 0:
            continue
        worst = max(worst, tensor_rel_diff(g, w))
    return {"keys": list(got) == list(want), "shapes": all(k in got and got[k].shape == w.shape
                                                            for k, w in want.items()),
            "rel": worst, "min_numel": min(t.numel() for t in got.values())}


def count_gathers(engine) -> dict:
    """Wrap each unit's gather (this instance only) to count the calls by unit name."""
    counts = {u.name: 0 for u in engine.units}
    for unit in engine.units:
        def counted(comm, unit=unit, inner=unit.gather):
            counts[unit.name] += 1
            return inner(comm)
        unit.gather = counted
    return counts


def gathered_units(engine) -> list[str]:
    return [u.name for u in engine.units if u.sharded_groups and u.state.value == "gathered"]


def config_of(case: dict) -> zs.ZeroConfig:
    cfg = dict(case["config"])
    preset = cfg.pop("preset", None)
    return zs.ZeroConfig.preset(preset, **cfg) if preset else zs.ZeroConfig(**cfg)


def run_case(case: dict) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(11)
    base = TinyLM(layers=3)
    ref = copy.deepcopy(base)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(param_groups(ref))
    model = copy.deepcopy(base)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), config_of(case))
    engine = zs.api._engine_of(model)
    losses = []

    def step(i):
        tokens, targets = batch(rank, i, 0)
        lr_ = loss_fn(ddp(tokens), targets)
        lr_.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        lz = loss_fn(model(tokens), targets)
        lz.backward()
        zopt.step()
        zopt.zero_grad()
        losses.append((lz.item(), lr_.item()))

    for i in range(3):
        step(i)
    out: dict = {"name": case["name"], "stage": engine.config.stage}

    counts = count_gathers(engine)
    sd = model.state_dict()
    out["gathers"] = dict(counts)
    out["gathered_after"] = gathered_units(engine)
    out["model"] = compare(sd, ref.state_dict())
    out["tied_one_tensor"] = sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr()
    out["ref_tied_one_tensor"] = (ref.state_dict()["head.weight"].data_ptr()
                                  == ref.state_dict()["embed.weight"].data_ptr())

    for k in counts:
        counts[k] = 0
    out["block"] = compare(model.layers[1].state_dict(), ref.layers[1].state_dict())
    out["inside_block"] = compare(model.layers[2].fc1.state_dict(), ref.layers[2].fc1.state_dict())
    out["head"] = compare(model.head.state_dict(), ref.head.state_dict())
    out["layers"] = compare(model.layers.state_dict(), ref.layers.state_dict())
    out["submodule_gathers"] = dict(counts)
    out["gathered_after_submodules"] = gathered_units(engine)

    with zs.gathered_parameters(model):
        inside = model.state_dict()
    out["inside_gathered_parameters"] = compare(inside, ref.state_dict())  # read after the block

    step(3)
    out["losses"] = losses
    out["after_step"] = compare(zs.full_state_dict(model), ref.state_dict())
    zs.teardown(model, keep_weights=False)
    return out


def main() -> None:
    args, out = start()
    results = []
    for case in args["cases"]:
        try:
            results.append(run_case(case))
        except Exception:  # report, and stop: the ranks may no longer be in lock-step
            results.append({"name": case["name"], "error": traceback.format_exc()})
            print(traceback.format_exc(), file=sys.stderr)
            break
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
