"""Sharded checkpoints of an expert-parallel model (tests/test_expert_parallel_checkpoint.py).

Every case builds the tiny Mixtral of tests/workers/expert_parallel.py with the same seed, sets it up
with ``expert_parallel_size`` (stage 3, AdamW) and trains on this rank's share of the batch of each
step, so the routing differs by rank. The cases of one launch share a process group; the test runs the
save and the resume in different launches (a fresh process group, fresh processes), as a user does.

* ``reference``: 4 uninterrupted steps (losses, full weights), and one process training a copy of the
  model on the whole batch (its losses and weights);
* ``save``: 2 steps, then ``save_checkpoint`` (``async_save`` as the case says); the model's logits on
  fixed tokens, and its Hugging Face config beside the checkpoint (``<path>-config``);
* ``resume``: a model built from another seed (so nothing matches unless the load sets it), set up with
  ``ep`` on this launch's world (at ``stage``, 3 unless given), ``load_checkpoint``, 2 more steps: losses and full weights;
* ``weights_without_ep``: ``load_checkpoint(..., optimizer=None)`` into a model without expert
  parallelism (the experts sharded as any parameter): its full weights;
* ``tamper``/``missing``/``into_dense``/``dense_into_ep``/``dcp``: what a load or a save of that kind
  raises, and whether the model kept its weights;
* ``state_dict``: ``optimizer.state_dict()`` after 2 steps, the experts' state cleared, restored by
  ``load_state_dict``, then 2 more steps (losses, weights).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from _worker import finish, run_cases, start
from expert_parallel import _batch, _model, _steps

import zero_strategy as zs
import zero_strategy.checkpoint as zc

LR = dict(lr=1e-2, weight_decay=0.1)


def _setup(ep: int, seed: int = 5, stage: int = 3):
    model = _model("mixtral")
    if seed != 5:
        torch.manual_seed(seed)
        for p in model.parameters():
            p.data.normal_(0, 0.05)
    config = zs.ZeroConfig(stage=stage, param_persistence_threshold=0, expert_parallel_size=ep)
    return zs.setup(model, torch.optim.AdamW(model.parameters(), **LR), config)


def _weights(model) -> dict[str, list]:
    return {k: v.tolist() for k, v in zs.full_state_dict(model).items()}


def reference(case: dict) -> dict:
    model = _model("mixtral")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    ref_losses = []
    for step in range(4):
        whole, _ = _batch(dist.get_rank(), step)
        loss = ref(input_ids=whole, labels=whole).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    model, opt = _setup(case["ep"])
    losses = _steps(model, opt, range(4))
    return dict(case=case["case"], losses=losses, weights=_weights(model), one_process_losses=ref_losses,
                one_process_weights={k: v.tolist() for k, v in ref.state_dict().items()})


def save(case: dict) -> dict:
    model, opt = _setup(case["ep"])
    losses = _steps(model, opt, range(2))
    zc.save_checkpoint(case["path"], model, opt, extra_state={"step": 2}, async_save=case.get("async_save", False))
    zc.wait_for_save(model)
    files = sorted(p.name for p in Path(case["path"]).iterdir())
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))  # the same on every rank
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    if dist.get_rank() == 0:  # for the test's from_pretrained of the consolidated checkpoint
        model.config.save_pretrained(case["path"] + "-config")
    return dict(case=case["case"], losses=losses, files=files, weights=_weights(model),
                tokens=tokens.tolist(), logits=logits.tolist())


def resume(case: dict) -> dict:
    model, opt = _setup(case["ep"], seed=11, stage=case.get("stage", 3))
    extra = zc.load_checkpoint(case["path"], model, opt)
    losses = _steps(model, opt, range(2, 4))
    return dict(case=case["case"], extra=extra, losses=losses, weights=_weights(model))


def weights_without_ep(case: dict) -> dict:
    """The checkpoint's weights into a model set up without expert parallelism (optimizer=None)."""
    model, _ = _setup(1, seed=11)
    zc.load_checkpoint(case["path"], model, None)
    return dict(case=case["case"], weights=_weights(model))


def _copy(src: str, dst: str) -> None:
    if dist.get_rank() == 0:
        shutil.copytree(src, dst)
    dist.barrier()


def refused(case: dict) -> dict:
    """What loading (or saving) the damaged checkpoint of ``case`` raises; the model untouched?"""
    what = case["what"]
    target = case["path"] + f"-{what}"
    if what in ("tamper", "missing"):
        _copy(case["path"], target)
        if dist.get_rank() == 0:
            victim = Path(target) / "experts00001-of-00002.safetensors"
            if what == "missing":
                victim.unlink()
            else:
                data = bytearray(victim.read_bytes())
                data[-3] ^= 0x40  # a byte of the last expert's last tensor
                victim.write_bytes(bytes(data))
        dist.barrier()
    elif what == "dense_into_ep":  # a checkpoint saved without expert parallelism
        dense, dense_opt = _setup(1)
        zc.save_checkpoint(target, dense, dense_opt)
        zs.teardown(dense, keep_weights=False)
    elif what == "into_dense":
        target = case["path"]
    model, opt = _setup(1 if what == "into_dense" else case["ep"], seed=11)
    before = zs.full_state_dict(model)
    message = None
    try:
        if what == "dcp":
            zc.save_dcp(target, model, opt)
        else:
            zc.load_checkpoint(target, model, opt)
    except Exception as err:  # noqa: BLE001 - reported
        message = f"{type(err).__name__}: {err}"
    after = zs.full_state_dict(model)
    return dict(case=case["case"], message=message,
                untouched=all(torch.equal(before[k], after[k]) for k in before))


def state_dict_round_trip(case: dict) -> dict:
    model, opt = _setup(case["ep"])
    _steps(model, opt, range(2))
    saved = copy.deepcopy(opt.state_dict())
    has_experts = bool(saved.get("expert_parallel", {}).get("state"))
    opt.rank_local.inner.state.clear()  # the experts' moments and step gone: only the load brings them back
    opt.load_state_dict(saved)
    losses = _steps(model, opt, range(2, 4))
    wrong = dict(saved, expert_parallel_size=None)
    try:
        opt.load_state_dict(wrong)
        message = None
    except ValueError as err:
        message = str(err)
    return dict(case=case["case"], losses=losses, weights=_weights(model), has_experts=has_experts,
                wrong_size_message=message)


def run(case: dict) -> dict:
    kind = case["kind"]
    return {"reference": reference, "save": save, "resume": resume, "refused": refused,
            "state_dict": state_dict_round_trip, "weights_without_ep": weights_without_ep}[kind](case)


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run)})


if __name__ == "__main__":
    main()
