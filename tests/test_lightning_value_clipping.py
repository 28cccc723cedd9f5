"""Gradient clipping by value in the Trainer and in Fabric equals DDP with the same clipping.

``Trainer(gradient_clip_val=v, gradient_clip_algorithm="value")`` and
``fabric.clip_gradients(model, optimizer, clip_val=v)`` clamp every gradient element to
[-v, v], as ``torch.nn.utils.clip_grad_value_`` does on the DDP model (2 gloo ranks, with
gradient accumulation in the Trainer). ``v`` is small enough that most elements are clamped:
the clipped DDP run must differ from the unclipped one, or the comparison proves nothing.
"""

from __future__ import annotations

import pytest
import torch

from _launch import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

CLIP = 2e-3
ZERO = {"zero1": "zero1", "zero2": "zero2", "zero3": {"stage": 3, "param_persistence_threshold": 0},
        "zero2_offload": "zero2_offload"}


def _cases(save_dir, clip_key: str, **common) -> list[dict]:
    cases = [dict(name="ddp_unclipped", strategy="ddp", **common)]
    cases += [dict(name=n, strategy=s, **{clip_key: CLIP}, **common) for n, s in {"ddp": "ddp", **ZERO}.items()]
    for c in cases:
        c["save_dir"] = str(save_dir)
    return cases


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("value_clip_trainer")
    cases = _cases(save_dir, "clip", clip_algorithm="value", accumulate=2, batch=2, epochs=2)
    cases[0].pop("clip_algorithm")
    return launch("lightning_trainer.py", 2, {"cases": cases}, timeout=300), save_dir


@pytest.fixture(scope="module")
def fabric_run(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("value_clip_fabric")
    return launch("lightning_fabric.py", 2, {"cases": _cases(save_dir, "clip_val")}, timeout=300), save_dir


def _weights(save_dir, name):
    return torch.load(save_dir / f"{name}.pt")


def _check(reports, save_dir, name):
    for r in reports:
        for case in ("ddp_unclipped", "ddp", name):
            assert "error" not in r[case], f"{case}: {r[case]['error']}\n{r[case].get('trace', '')}"
    ddp, unclipped, ours = (_weights(save_dir, n) for n in ("ddp", "ddp_unclipped", name))
    effect = max((ddp[k] - unclipped[k]).abs().max().item() for k in ddp)
    assert effect > 1e-4, f"clipping had no effect ({effect})"
    assert ours.keys() == ddp.keys()
    for k in ddp:
        torch.testing.assert_close(ours[k], ddp[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    for r in reports:
        assert r[name]["losses"] == pytest.approx(r["ddp"]["losses"], rel=1e-5)


@pytest.mark.parametrize("name", list(ZERO))
def test_trainer_value_clipping_equals_ddp(trainer_run, name):
    _check(*trainer_run, name)


@pytest.mark.parametrize("name", list(ZERO))
def test_fabric_value_clipping_equals_ddp(fabric_run, name):
    _check(*fabric_run, name)
