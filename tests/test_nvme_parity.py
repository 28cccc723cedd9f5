"""NVMe offload (ZeRO-Infinity) trains exactly like DDP.

zero3_offload_nvme (optimizer state and parameter shards in the swap file) and
optimizer-only NVMe offload at stages 1-2, fp32 and bf16, with accumulation and
clipping, 2 gloo ranks, swap files in a per-test temporary directory. Small I/O
requests (16 KiB) so every group is split over several concurrent reads and writes.
"""

from __future__ import annotations

import pytest

from _launch import launch


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nvme"))
    cases = [dict(stage=3, precision=p, accum=a, offload_optimizer="nvme", offload_params="nvme")
             for p in ("fp32", "bf16") for a in (1, 2)]
    cases += [dict(stage=s, precision="fp32", accum=2, offload_optimizer="nvme") for s in (1, 2)]
    cases += [dict(stage=2, precision="bf16", accum=1, offload_optimizer="nvme", clip=0.05)]
    cases += [dict(stage=3, precision="fp32", accum=1, offload_optimizer="cpu", offload_params="nvme",
                   optimizer="sgd")]
    for c in cases:
        c["nvme_path"] = path
    return launch("parity.py", 2, {"cases": cases}, timeout=240), path


@pytest.mark.multiprocess
def test_nvme_offload_matches_ddp(results):
    reports, _ = results
    for rank, rep in enumerate(reports):
        assert len(rep["results"]) == 8
        for res in rep["results"]:
            assert "error" not in res, res["error"]
            tol = 1e-5 if res["case"]["precision"] == "fp32" else 5e-2
            for zero, ref in zip(res["losses_zero"], res["losses_ref"]):
                assert zero == pytest.approx(ref, rel=1e-5 if tol == 1e-5 else 2e-3), res["case"]
            assert res["weight_rel_diff"] <= tol, (rank, res["case"], res["worst_tensor"])


@pytest.mark.multiprocess
def test_swap_files_are_gone_after_the_run(results):
    _, path = results
    import os
    assert [f for f in os.listdir(path) if f.startswith("zero_swap")] == []
