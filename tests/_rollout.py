"""One training run of the shared tiny model with an optional offload/reload round trip in it.

Used by test_offload_states.py in one process and by workers/offload_states.py on 2 ranks:
the same steps with and without the round trip must end bit for bit equal (weights from
``zs.full_state_dict`` and every optimizer state tensor), which is the whole contract of
``reload_states``. The round trip happens either after ``step()``/``zero_grad()`` (a rollout
phase) or between ``backward()`` and ``step()`` (gradients held, so gradient kinds move too).
"""

from __future__ import annotations

import torch

import zero_strategy as zs
from _models import TinyLM, batch, loss_fn, param_groups

STEPS = 3


def optimizer_state(zopt) -> list[dict[str, torch.Tensor]]:
    """Every state tensor, in param-group order, cloned (host copies compare on any device)."""
    return [{k: v.detach().clone().cpu() for k, v in zopt.optimizer.state.get(p, {}).items()
             if isinstance(v, torch.Tensor)}
            for pg in zopt.optimizer.param_groups for p in pg["params"]]


def train(config, *, include=None, at: str | None = None, rank: int = 0, generate: bool = False,
          steps: int = STEPS) -> dict:
    """Train ``steps`` steps; with ``at`` ("after_step" / "before_step"), round-trip the ``include``
    kinds at every step there. ``generate``: a no-grad forward while offloaded, as a rollout does.
    Returns the final weights and optimizer state, the losses, and memory reports around the
    first offload."""
    torch.manual_seed(0)
    model = TinyLM(layers=3)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), config)
    losses, reports, rollout_logits = [], {}, []

    def round_trip(step):
        before = zs.memory_report(model)
        zs.offload_states(model, zopt, include=include)
        if step == 0:
            reports["before"], reports["offloaded"] = before, zs.memory_report(model)
        if generate:
            with torch.no_grad():
                rollout_logits.append(model(batch(rank, step, 7)[0]).detach().clone())
        zs.reload_states(model, zopt)
        if step == 0:
            reports["reloaded"] = zs.memory_report(model)

    for step in range(steps):
        tokens, targets = batch(rank, step, 0)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        losses.append(loss.item())
        if at == "before_step":
            round_trip(step)
        zopt.step()
        zopt.zero_grad()
        if at == "after_step":
            round_trip(step)
    out = {"weights": zs.full_state_dict(model), "state": optimizer_state(zopt), "losses": losses,
           "reports": reports, "rollout_logits": rollout_logits}
    zs.teardown(model, keep_weights=False)
    return out


def same(a: dict, b: dict) -> bool:
    """Bitwise equal weights and optimizer state."""
    return (a["weights"].keys() == b["weights"].keys()
            and all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
            and len(a["state"]) == len(b["state"])
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                    for x, y in zip(a["state"], b["state"])))


def adam_state_bytes(model_groups) -> int:
    """The formula: Adam keeps two fp32 moments per element of this rank's master shards."""
    return sum(8 * g.shard_numel for g in model_groups)
