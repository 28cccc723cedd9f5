"""Gradient checkpointing under each stage against torch DDP without checkpointing.

Two models, two ways of checkpointing:
* ``llama``: a tiny Hugging Face ``LlamaForCausalLM`` with
  ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ...})``.
  Transformers checkpoints each decoder layer's ``forward``, so the unit's module hooks
  run outside the checkpointed region.
* ``torch``: the parity TinyLM whose forward calls
  ``torch.utils.checkpoint.checkpoint(block, h, use_reentrant=...)``: the block's
  ``__call__``, hooks included, runs inside the region and again in the recompute.

Bases: ``full`` (everything trains), ``frozen`` (TinyLM: embedding/head, norms and fc1
frozen, so the root unit has no trainable parameter), ``lora`` (Llama through peft).
``calls=2`` runs the model twice per iteration (two losses, one backward): with
reentrant checkpointing each call's blocks come back in their own nested backward.

The reference is DDP over the same model without checkpointing (the ground truth
checkpointing must not change), on the same per-rank batches. Each case reports both
losses, the worst relative weight difference, and the communication counters of the
last step split into forward, backward (recompute included) and step, with the
parameter counts per unit the communication theory needs.

args["cases"]: list of {model, base, stage, ckpt (None|"reentrant"|"non_reentrant"), calls}.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _worker import finish, run_cases, start, worst_rel_diff
from _checkpointing import CheckpointedLM
from _models import batch, loss_fn, tiny_llama_config

import zero_strategy as zs

# Two steps: the first creates AdamW's state, the second uses it, and each recomputes; the counters
# of the communication test are the second's, a step like every later one
STEPS = 2
warnings.filterwarnings("ignore", message=".*gradient_checkpointing_enable.*deprecated")


def _reentrant(case: dict) -> bool | None:
    return None if case["ckpt"] is None else case["ckpt"] == "reentrant"


def build(case: dict, checkpointed: bool) -> torch.nn.Module:
    """The case's model, identical on every rank and for every call (seeded)."""
    reentrant = _reentrant(case) if checkpointed else None
    torch.manual_seed(3)
    if case["model"] == "torch":
        model = CheckpointedLM(reentrant)
        if case["base"] == "frozen":
            for name, p in model.named_parameters():
                if not name.startswith("layers.") or ".norm." in name or ".fc1." in name:
                    p.requires_grad_(False)
        return model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config())
    model.train()
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if case["base"] == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(4)  # LoRA A matrices: random; B: zeros
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def loss_of(model, case: dict, rank: int, step: int) -> torch.Tensor:
    """The iteration's loss: one call of the model, or ``calls`` calls on different micro-batches."""
    total = 0.0
    for micro in range(case["calls"]):
        tokens, targets = batch(rank, step, micro)
        if case["model"] == "torch":
            total = total + loss_fn(model(tokens), targets)
        else:
            ids = tokens % 64
            total = total + model(input_ids=ids, labels=ids).loss
    return total


def optimizer_for(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


_REFERENCES: dict = {}


def reference(case: dict, rank: int) -> tuple[list[float], dict]:
    """DDP without checkpointing: losses per step and final weights (one run per model/base/calls)."""
    key = (case["model"], case["base"], case["calls"])
    if key not in _REFERENCES:
        model = build(case, checkpointed=False)
        ddp, opt = DDP(model), optimizer_for(model)
        losses = []
        for step in range(STEPS):
            loss = loss_of(ddp, case, rank, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        _REFERENCES[key] = (losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return _REFERENCES[key]


def parameter_sizes(model) -> list[tuple[str, int, bool]]:
    """(first name, elements, requires_grad) of each distinct parameter, before setup shards them."""
    seen, out = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p.numel(), p.requires_grad))
    return out


def unit_counts(sizes: list, engine) -> list[dict]:
    """Per unit: unsharded elements, trainable and frozen, and how many flat groups it has.
    What the communication theory is computed from."""
    prefixes = [u.name + "." for u in engine.units[1:]]
    per: dict[str, dict] = {u.name: dict(name=u.name, trainable=0, frozen=0) for u in engine.units}
    for name, numel, trainable in sizes:
        unit = next((pre[:-1] for pre in prefixes if name.startswith(pre)), "<root>")
        per[unit]["trainable" if trainable else "frozen"] += numel
    for u in engine.units:
        per[u.name]["sharded_groups"] = len(u.sharded_groups)
        per[u.name]["trainable_groups"] = sum(1 for g in u.groups if g.trainable)
    return list(per.values())


def count_recomputes(model) -> list[int]:
    """A one-element counter of the first block's MLP forwards run inside backward: proof that
    checkpointing is on (the recompute) and that without it nothing is recomputed."""
    mlp = next(m for name, m in model.named_modules() if name.endswith("layers.0.mlp") or name == "layers.0.fc1")
    counter = [0]

    def hook(module, args):
        if torch._C._current_graph_task_id() != -1:
            counter[0] += 1
    mlp.register_forward_pre_hook(hook)
    return counter


def run_case(case: dict) -> dict:
    rank = dist.get_rank()
    ref_losses, ref_weights = reference(case, rank)
    model = build(case, checkpointed=True)
    sizes = parameter_sizes(model)
    model, zopt = zs.setup(model, optimizer_for(model),
                           zs.ZeroConfig(stage=case["stage"], param_persistence_threshold=0))
    engine = zs.api._engine_of(model)
    recomputes = count_recomputes(model)
    losses, phases, gathered_after = [], {}, []
    for step in range(STEPS):
        loss = loss_of(model, case, rank, step)
        phases["forward"] = engine.comm.stats.as_dict()
        loss.backward()
        phases["backward"] = engine.comm.stats.as_dict()
        gathered_after += [u.name for u in engine.units if u.sharded_groups and u.state.value == "gathered"]
        zopt.step()
        zopt.zero_grad()
        losses.append(loss.item())
    rel, worst = worst_rel_diff(zs.full_state_dict(model), ref_weights)
    return dict(case=case, losses_zero=losses, losses_ref=ref_losses, weight_rel_diff=rel, worst=worst,
                comm_forward=phases["forward"], comm_to_backward=phases["backward"],
                comm_step=zs.comm_stats(model), units=unit_counts(sizes, engine),
                gathered_after_backward=gathered_after, recomputes=recomputes[0])


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run_case)})


if __name__ == "__main__":
    main()
