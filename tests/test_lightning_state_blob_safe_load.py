"""The Lightning state blob inside a checkpoint is never fully unpickled unless the user asks
(``weights_only=False``): ``None`` means ``True`` on every supported torch (2.4-2.5 read
``None`` as a full pickle). Lightning's own state (plain dicts, lists, numbers, tensors) loads.
"""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("lightning")

from zero_strategy.lightning._checkpoint import pack, unpack  # noqa: E402


class Payload:
    """Stands for any class a crafted pickle could name (os.system, ...)."""

    def __init__(self):
        self.ran = True


def test_lightning_state_loads():
    import torch

    state = {"epoch": 3, "global_step": 12, "hyper_parameters": {"lr": 0.1, "layers": 2},
             "loops": {"fit_loop": {"state_dict": {}}}, "lr_schedulers": [{"last_epoch": 3}],
             "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.5)}}}
    got = unpack(pack(state))
    assert got["epoch"] == 3 and got["hyper_parameters"] == {"lr": 0.1, "layers": 2}
    assert torch.equal(got["callbacks"]["ModelCheckpoint"]["best_model_score"], torch.tensor(0.5))


@pytest.mark.parametrize("weights_only", [None, True])
def test_arbitrary_objects_are_refused_by_default(weights_only):
    blob = pack({"epoch": 1, "callbacks": {"x": Payload()}})
    with pytest.raises(pickle.UnpicklingError, match=r"(?s)Weights only load failed.*Unsupported global: .*Payload"):
        unpack(blob, weights_only=weights_only)


def test_full_unpickle_only_when_asked():
    got = unpack(pack({"callbacks": {"x": Payload()}}), weights_only=False)
    assert got["callbacks"]["x"].ran
