"""``model.load_state_dict(sd)`` on a set-up model, against a reference that loads the same sd.

args["cases"]: parity-style cases (stage, precision, offload_optimizer, offload_params,
nvme_path). The reference is workers/parity.py's ``Reference``: DDP, and for bf16 the
textbook recipe (fp32 master model + bf16 compute copy), which loads a state dict into
its fp32 masters and casts the compute copy from them, as a plain mixed-precision
model would. After 2 training steps on both, each rank, in the user's own idiom:

1. ``model.load_state_dict(other)`` (another model's full fp32 state dict): weights
   right after the load, then one step;
2. ``model.layers[1].load_state_dict(block)`` (a submodule), then one step;
3. ``strict=False`` with one key missing and one unexpected: the returned keys, then one step;
4. ``strict=True`` with one key missing: the error message, then one step (torch has
   copied the keys that were there before it raises, and so must we);
5. ``assign=True``: refused (it would replace the engine's views), nothing changes.

Reported: losses of every step and the largest relative weight difference after each
action (``zs.full_state_dict``, the masters, against the reference's).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from _compare import rel_diff
from _worker import finish, run_cases, start
from _models import TinyLM, batch, loss_fn, param_groups
from parity import Reference, _offload

import zero_strategy as zs


def other_weights(seed: int) -> dict:
    """Another model's plain fp32 state dict (the same on every rank)."""
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in TinyLM(layers=3).state_dict().items()}


def ref_load(ref: Reference, module_path: str, sd: dict, strict: bool = True):
    """Load into the reference's fp32 masters and cast its compute copy from them."""
    target = ref.master.get_submodule(module_path)
    try:
        return target.load_state_dict(sd, strict=strict), None
    except RuntimeError as err:
        return None, f"{type(err).__name__}: {err}"
    finally:
        if ref.compute is not ref.master:
            with torch.no_grad():
                for pm, pc in zip(ref.master.parameters(), ref.compute.parameters()):
                    pc.copy_(pm)


def zero_load(model, module_path: str, sd: dict, strict: bool = True, **kwargs):
    target = model.get_submodule(module_path)
    try:
        return target.load_state_dict(sd, strict=strict, **kwargs), None
    except (RuntimeError, ValueError) as err:
        return None, f"{type(err).__name__}: {err}"


def run_case(case: dict) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(1234)
    base = TinyLM(layers=3)
    ref = Reference(base, case)
    model = copy.deepcopy(base)
    cfg = zs.ZeroConfig(stage=case["stage"], precision=case["precision"], param_persistence_threshold=0,
                        offload_optimizer=_offload(case.get("offload_optimizer"), case),
                        offload_params=_offload(case.get("offload_params"), case))
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95)), cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(zopt, lambda s: 1.0 / (1 + s))  # as the Reference's
    engine = zs.api._engine_of(model)
    losses: list = []
    out: dict = {"case": case, "losses": losses}

    def step(i):
        tokens, targets = batch(rank, i, 0)
        lr_ = ref.micro_step(tokens, targets, 1, True)
        ref.step(None)
        lz = loss_fn(model(tokens), targets)
        zopt.backward(lz)
        zopt.step()
        zopt.zero_grad()
        sched.step()
        losses.append((lz.item(), lr_))

    def weights_now():
        return rel_diff(zs.full_state_dict(model), ref.full_state_dict())

    for i in range(2):
        step(i)

    # 1. a whole other model's weights
    full = other_weights(99)
    zero_load(model, "", full)
    ref_load(ref, "", full)
    out["loaded"] = weights_now()
    step(2)
    out["after_load_step"] = weights_now()

    # 2. one block, through the submodule
    block = {k[len("layers.1."):]: v for k, v in other_weights(7).items() if k.startswith("layers.1.")}
    zero_load(model, "layers.1", block)
    ref_load(ref, "layers.1", block)
    out["block_loaded"] = weights_now()
    step(3)

    # 3. strict=False: a missing and an unexpected key
    partial = {k: v for k, v in other_weights(5).items() if k != "final_norm.bias"}
    partial["bogus.weight"] = torch.zeros(3)
    got, _ = zero_load(model, "", partial, strict=False)
    want, _ = ref_load(ref, "", partial, strict=False)
    out["non_strict_keys"] = [sorted(got.missing_keys), sorted(got.unexpected_keys)]
    out["non_strict_keys_ref"] = [sorted(want.missing_keys), sorted(want.unexpected_keys)]
    out["non_strict_loaded"] = weights_now()
    step(4)

    # 4. strict=True with a missing key raises, after copying the keys that are there
    missing = {k: v for k, v in other_weights(6).items() if k != "layers.2.fc2.weight"}
    _, out["strict_error"] = zero_load(model, "", missing)
    _, out["strict_error_ref"] = ref_load(ref, "", missing)
    out["strict_loaded"] = weights_now()
    step(5)

    # 5. assign=True would swap the engine's storage out from under it
    _, out["assign_error"] = zero_load(model, "", other_weights(8), assign=True)
    out["assign_unchanged"] = weights_now()
    step(6)

    out["final"] = weights_now()
    out["gathered_after"] = [u.name for u in engine.units if u.sharded_groups and u.state.value == "gathered"]
    zs.teardown(model, keep_weights=False)
    return out


def main() -> None:
    args, out = start()
    results = run_cases(args["cases"], run_case)
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
