"""A pass over the whole model gives the idle NVMe staging back, and training goes on unchanged
(See [Note: staging between passes] in _mechanisms/memory.py).

The staging pool keeps its slots between steps. A checkpoint save, a save and load round trip
and a ``full_state_dict`` free the slots no one holds, before and after: the engine's own
accounting (``memory_report``'s "staging") is zero after each of them, and back above zero
after the next step, which allocates what it uses. What the run computes does not change:
a run with those passes between its steps ends with the weights and optimizer state of the
same run without them, bit for bit, and close to a plain torch model (the independent
oracle). ``release_host_memory=False`` keeps the slots.
"""

from __future__ import annotations

import copy

import pytest
import torch

import zero_strategy as zs
from _habits import train
from _models import TinyLM, param_groups

pytestmark = pytest.mark.timeout(180, method="thread")

BUFFER = 64 * 1024  # bytes per slot: the root group streams through several


def _model():
    torch.manual_seed(0)
    return TinyLM(layers=2, dim=48, vocab=2048)


def _setup(model, tmp_path, name, release=True):
    nvme = {"device": "nvme", "path": str(tmp_path / name), "buffer_size": BUFFER}
    opt = torch.optim.AdamW(param_groups(model), lr=3e-3)
    return zs.setup(model, opt, zs.ZeroConfig(stage=3, param_persistence_threshold=0, offload_optimizer=nvme,
                                              offload_params=nvme, release_host_memory=release))


def _staging(model) -> int:
    return zs.memory_report(model).by_category["staging"]


def test_each_pass_frees_the_idle_slots_and_training_is_unchanged(tmp_path):
    plain = _model()
    passes, passes_opt = _setup(copy.deepcopy(plain), tmp_path, "passes")
    twin, twin_opt = _setup(copy.deepcopy(plain), tmp_path, "twin")
    plain_opt = torch.optim.AdamW(param_groups(plain), lr=3e-3)
    calls = {
        "save_checkpoint": lambda: zs.save_checkpoint(tmp_path / "ckpt", passes, passes_opt),
        # a round trip: the load brings back the state just saved (its slots are dropped at its end)
        "save_and_load_checkpoint": lambda: (zs.save_checkpoint(tmp_path / "ckpt2", passes, passes_opt),
                                             zs.load_checkpoint(tmp_path / "ckpt2", passes, passes_opt)),
        "full_state_dict": lambda: zs.full_state_dict(passes),
    }
    for step, (name, call) in enumerate(calls.items()):
        for model, opt in ((passes, passes_opt), (twin, twin_opt), (plain, plain_opt)):
            train(model, opt, [step])
        assert _staging(passes) > 0, "the pool holds its slots between steps"
        call()
        assert _staging(passes) == 0, f"{name} left {_staging(passes)} bytes of idle staging"
    for model, opt in ((passes, passes_opt), (twin, twin_opt), (plain, plain_opt)):
        train(model, opt, [3, 4])
    assert _staging(passes) > 0
    got, want = zs.full_state_dict(passes), zs.full_state_dict(twin)
    for key, ref in plain.state_dict().items():
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
        torch.testing.assert_close(got[key], ref, rtol=1e-5, atol=1e-6, msg=key)
    got_state = passes_opt.state_dict()["optimizer"]["state"]
    want_state = twin_opt.state_dict()["optimizer"]["state"]
    for i in want_state:
        for k, v in want_state[i].items():
            torch.testing.assert_close(got_state[i][k], v, rtol=0, atol=0, msg=f"state {i}.{k}")


def test_release_host_memory_off_keeps_the_slots(tmp_path):
    model, opt = _setup(_model(), tmp_path, "kept", release=False)
    train(model, opt, [0])
    held = _staging(model)
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    zs.full_state_dict(model)
    assert held > 0 and _staging(model) >= held
