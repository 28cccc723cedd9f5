"""``zero_strategy.setup(model, opt, "zero_auto")`` on every rank, beside the preset it chose set
up by hand, from the same weights and data. Memory is measured for real (no injection):
the ranks exchange what they measured and must agree on one preset.

Reports per run: the chosen stage and offload, per-step losses, and the largest relative
difference of the final full weights between the auto run and the by-hand run.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from _models import TinyLM, batch, loss_fn, param_groups
from _worker import finish, start, worst_rel_diff

import zero_strategy as zs


def _train(base, config):
    model = copy.deepcopy(base)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), config)
    chosen = zs.engine_of(model).config
    losses = []
    for step in range(3):
        tokens, targets = batch(dist.get_rank(), step, 0)
        loss = loss_fn(model(tokens), targets)
        zopt.backward(loss)
        zopt.step()
        zopt.zero_grad()
        losses.append(loss.item())
    full = zs.full_state_dict(model)
    zs.teardown(model)
    return chosen, losses, full


def main() -> None:
    args, out = start()
    torch.manual_seed(0)
    base = TinyLM(layers=2)
    chosen, losses_auto, auto_sd = _train(base, "zero_auto")
    by_hand = {(2, "none", "none"): "zero2", (3, "none", "none"): "zero3", (2, "cpu", "none"): "zero2_offload",
               (3, "cpu", "cpu"): "zero3_offload", (3, "nvme", "nvme"): "zero3_offload_nvme"}
    key = (chosen.stage, getattr(chosen.offload_optimizer, "device", "none"),
           getattr(chosen.offload_params, "device", "none"))
    _, losses_hand, hand_sd = _train(base, by_hand[key])
    diff, name = worst_rel_diff(auto_sd, hand_sd)
    finish(out, {"chosen": by_hand[key], "auto_flag_left": chosen.auto, "losses_auto": losses_auto,
                 "losses_hand": losses_hand, "weight_rel_diff": diff, "worst": name})


if __name__ == "__main__":
    main()
