"""What a refused load must leave alone, and the damages that refuse one (issue 38).

``snapshot(model, opt)`` is everything a user trains on: the fp32 masters (``full_state_dict``
reads them), every buffer, this rank's optimizer state (tensors and scalars), the
hyperparameters and the loss scaler. ``differences(before, after)`` names the entries that
changed. The damages hit the files a load reads *last* on some rank (another rank's file,
the buffers, the extra state), where a load that verifies each file as it opens it has
already copied the others.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import zero_strategy as zs
from _models import TinyLM, batch, loss_fn, param_groups


def build(stage: int = 2, seed: int = 0):
    """The model and optimizer; the checkpoints are saved from ``seed=1`` (the frozen weight differs too)."""
    torch.manual_seed(seed)
    model = TinyLM(layers=2)
    model.register_buffer("counts", torch.arange(4.0))
    return zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(stage=stage))


def train_step(model, opt, rank: int, step: int) -> float:
    tokens, targets = batch(rank, step, 0)
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model.counts.add_(1.0)  # a buffer that moves with training, as BatchNorm's do
    return loss.item()


def snapshot(model, opt) -> dict[str, object]:
    """Every value a refused load must not change (collective: every rank calls it)."""
    out: dict[str, object] = {f"weight {k}": v.clone() for k, v in zs.full_state_dict(model, dtype=None).items()}
    out.update({f"buffer {k}": b.detach().clone() for k, b in model.named_buffers()})
    sd = opt.state_dict()
    for i, state in sd["optimizer"]["state"].items():
        for k, v in state.items():
            out[f"optimizer state {i}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    for j, pg in enumerate(sd["optimizer"]["param_groups"]):
        out.update({f"hyperparameter {j}.{k}": v for k, v in pg.items()})
    out["loss scaler"] = sd["loss_scaler"]
    return out


def differences(before: dict, after: dict) -> list[str]:
    names = sorted(set(before) ^ set(after))
    for k in sorted(set(before) & set(after)):
        a, b = before[k], after[k]
        same = (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)) if isinstance(a, torch.Tensor) \
            else a == b
        if not same:
            names.append(k)
    return names


def flip_a_byte(path: Path) -> None:
    """Damage a file in the middle of its data (its digest no longer matches the metadata)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 + 3] ^= 0xFF
    path.write_bytes(bytes(data))


def damaged_copy(intact: Path, target: Path, file: str) -> Path:
    shutil.copytree(intact, target)
    flip_a_byte(target / file)
    return target
