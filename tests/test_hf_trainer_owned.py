"""The HF Trainer given Adafactor (torch's through ``optimizers=``, transformers' through
``optim="adafactor"``) under ZeRO equals the stock Trainer on DDP (2 CPU processes under
``accelerate launch``). Adafactor is all fp32, so 1e-4 relative (see tests/test_owned_optimizers.py);
its parameters are owned whole, one rank each (the ownership layout)."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from _accelerate_launch import accelerate_launch  # noqa: E402

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def reports():
    return accelerate_launch("hf_trainer_owned.py", {}, timeout=240, use_cpu=False)[0]


@pytest.mark.parametrize("name,optimizer", [("optimizers_arg", "torch.optim.Adafactor"),
                                            ("optim_adafactor", "transformers.optimization.Adafactor")])
def test_trainer_with_adafactor_equals_the_stock_ddp_trainer(reports, name, optimizer):
    for rank, rep in enumerate(reports):
        res = rep[name]
        assert res["owned"][0] == optimizer and res["owned"][1] > 0, res["owned"]
        assert res["losses"] == pytest.approx(res["ref_losses"], rel=1e-4), (rank, res)
        assert res["rel"] <= 1e-4, (rank, res)
