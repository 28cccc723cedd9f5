"""Checkpoints saved with hybrid sharding load flat, and the other way round (issue #15):
training continues as if it had never stopped.

4 gloo ranks (tests/workers/checkpoint.py: TinyLM, AdamW, one global batch of 8 samples
per step split over the ranks). The reference is one uninterrupted 6-step flat run on
4 ranks; the others save after 3 steps and resume for 3 more in the other layout
(``shard_group_size=2``: 2 groups of 2), at stage 2 and from stage 3 to stages 2 and 3.
Same world size and per-rank data, but hybrid sums the 4 ranks' gradients in another order
(inside the group, then across): 1e-6 relative, the tolerance across world sizes in
test_checkpoint_resume.py.
"""

from __future__ import annotations

import pytest
import torch

from _compare import rel_diff
from _launch import launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
TOL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid_ckpt")
    sd = lambda name: str(d / f"{name}.pt")  # noqa: E731
    first = [
        dict(name="ref", stage=2, precision="fp32", start=0, end=6, sd_out=sd("ref")),
        dict(name="flat", stage=2, precision="fp32", start=0, end=3, save={"3": str(d / "flat")}),
        dict(name="hybrid", stage=2, precision="fp32", start=0, end=3, save={"3": str(d / "hybrid")},
             shard_group_size=2),
        dict(name="hybrid3", stage=3, precision="fp32", start=0, end=3, save={"3": str(d / "hybrid3")},
             shard_group_size=2),
        dict(name="hybrid3_async", stage=3, precision="fp32", start=0, end=3,
             save={"3": str(d / "hybrid3_async")}, shard_group_size=2, async_save=True),
    ]
    resume = lambda name, stage, load, **kw: dict(name=name, stage=stage, precision="fp32", start=3, end=6,  # noqa: E731
                                                   load=str(d / load), sd_out=sd(name), **kw)
    second = [resume("hybrid_to_flat", 2, "hybrid"), resume("flat_to_hybrid", 2, "flat", shard_group_size=2),
              resume("hybrid3_to_flat3", 3, "hybrid3"), resume("hybrid3_to_hybrid2", 2, "hybrid3", shard_group_size=2)]
    out = {"dir": d}
    for cases in (first, second):
        for rank, rep in enumerate(launch("checkpoint.py", 4, {"cases": cases}, timeout=200)):
            for res in rep["results"]:
                assert "error" not in res, f"rank {rank}, case {res.get('name')}:\n{res['error']}"
                out.setdefault(res["name"], []).append(res)
    return out, sd


def _rel(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return rel_diff(a, b)


@pytest.mark.parametrize("name", ["hybrid_to_flat", "flat_to_hybrid", "hybrid3_to_flat3", "hybrid3_to_hybrid2"])
def test_resume_across_hybrid_and_flat_continues_the_run(runs, name):
    out, sd = runs
    ref_losses = out["ref"][0]["losses"]
    for rank, res in enumerate(out[name]):
        assert res["losses"] == pytest.approx(ref_losses[3:], rel=TOL), (rank, res["losses"], ref_losses)
    assert _rel(torch.load(sd(name)), torch.load(sd("ref"))) <= TOL
    assert ref_losses[0] != ref_losses[-1]


def test_an_asynchronous_hybrid_save_writes_the_synchronous_saves_files(runs):
    """Every rank of both shard groups joins the asynchronous save's agreement; the first group writes."""
    import filecmp

    out, _ = runs
    sync, asynchronous = out["dir"] / "hybrid3", out["dir"] / "hybrid3_async"
    names = sorted(p.name for p in sync.iterdir())
    assert names == sorted(p.name for p in asynchronous.iterdir())
    assert all(filecmp.cmp(sync / n, asynchronous / n, shallow=False) for n in names)
