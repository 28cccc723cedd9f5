"""``model.load_state_dict(sd)`` after setup works as on a plain model, at every stage.

Issue #11: torch's copy wrote only the compute-dtype parameters (at stage 3 it failed
on the released shapes), so the next ``optimizer.step()`` rebuilt the parameters from
the old fp32 masters and silently reverted the load. Now the load reaches the resting
shards and the masters (host or NVMe copies included), so every step after it equals
a reference that loaded the same state dict: DDP for fp32; for bf16 DDP plus the
textbook fp32-master recipe, whose masters take the state dict's fp32 values (a bf16
model must not round the masters it loads to bf16).

Per stage / precision / offload, 2 gloo ranks: a whole model's state dict, a
submodule's, ``strict=False`` (missing and unexpected keys reported as torch reports
them), ``strict=True`` with a missing key (raises torch's error, after copying what was
there, as torch does), and ``assign=True`` (refused: it would replace the engine's
views). Worker: tests/workers/load_state_dict.py.
"""

from __future__ import annotations

import pytest

from _launch import launch

CASES = [
    dict(stage=1, precision="fp32"),
    dict(stage=2, precision="fp32"),
    dict(stage=3, precision="fp32"),
    dict(stage=1, precision="bf16"),
    dict(stage=3, precision="bf16"),
    dict(stage=2, precision="bf16", offload_optimizer="cpu"),
    dict(stage=3, precision="fp32", offload_optimizer="cpu", offload_params="cpu"),
    dict(stage=3, precision="bf16", offload_optimizer="nvme", offload_params="nvme"),
]
# On 2 ranks both sides do the same arithmetic in the same order, bf16 included (see
# test_parity_ddp.py), so one tolerance holds; a bf16-rounded master would miss it by ~1e-3.
TOL = 1e-5


def _key(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(case.items()) if k != "nvme_path")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    path = str(tmp_path_factory.mktemp("nvme"))
    cases = [dict(c, nvme_path=path) for c in CASES]
    out: dict[str, list[dict]] = {}
    for rank, rep in enumerate(launch("load_state_dict.py", 2, {"cases": cases}, timeout=300)):
        for res in rep["results"]:
            assert "error" not in res, f"rank {rank}, case {res['case']}:\n{res['error']}"
            out.setdefault(_key(res["case"]), []).append(res)
    return out


def per_rank(results, case) -> list[dict]:
    got = results[_key(case)]
    assert len(got) == 2, "the case did not finish on both ranks"
    return got


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_loaded_weights_reach_the_masters(results, case):
    for res in per_rank(results, case):
        assert res["loaded"] < TOL, f"right after load_state_dict: {res['loaded']:.2e} from the reference"
        assert res["block_loaded"] < TOL, "after model.layers[1].load_state_dict(...)"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_training_after_a_load_equals_the_reference(results, case):
    for res in per_rank(results, case):
        for step, (lz, lr) in enumerate(res["losses"]):
            assert lz == pytest.approx(lr, rel=TOL), f"step {step}"
        assert res["after_load_step"] < TOL and res["final"] < TOL
        assert res["gathered_after"] == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_non_strict_load_reports_keys_as_torch(results, case):
    for res in per_rank(results, case):
        assert res["non_strict_keys"] == res["non_strict_keys_ref"] == [["final_norm.bias"], ["bogus.weight"]]
        assert res["non_strict_loaded"] < TOL  # the missing one kept its value, the rest loaded


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_strict_load_with_a_missing_key_raises_as_torch(results, case):
    for res in per_rank(results, case):
        assert res["strict_error_ref"] is not None
        assert res["strict_error"] == res["strict_error_ref"]
        assert 'Missing key(s) in state_dict: "layers.2.fc2.weight"' in res["strict_error"]
        assert res["strict_loaded"] < TOL  # what was there was copied before the error, as in torch


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=_key)
def test_assign_is_refused_and_changes_nothing(results, case):
    for res in per_rank(results, case):
        assert res["assign_error"] is not None and res["assign_error"].startswith("ValueError")
        assert "assign=True" in res["assign_error"]
        assert res["assign_unchanged"] < TOL
