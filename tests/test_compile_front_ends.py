"""torch.compile through the front ends, in each library's own idiom, on 2 CPU ranks.

* Lightning: compile inside ``configure_model`` (``block.compile()`` per block, as
  Lightning's model-parallel guide does after sharding), and ``trainer.fit(torch.compile(module))``
  (Lightning unwraps it and compiles ``training_step``/``forward``).
* Accelerate: ``accelerate launch --dynamo_backend aot_eager`` (whole model) and with
  ``--dynamo_use_regional_compilation`` (repeated blocks); the ZeroAccelerator compiles
  the prepared model in place.

Oracle: the same script without compile under the same strategy, and under DDP (plain
``strategy="ddp"`` / a plain ``Accelerator``), equal within fp32 tolerance (1e-5 relative,
as test_parity_ddp.py). Each compiled run also reports that compilation was applied.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from _compare import rel_diff
from _launch import launch

pytest.importorskip("lightning")
pytest.importorskip("accelerate")

from _accelerate_launch import accelerate_launch  # noqa: E402

TOL = 1e-5
ZERO3 = {"stage": 3, "param_persistence_threshold": 0}
LIGHTNING_CASES = [
    dict(name="ddp", strategy="ddp"),
    dict(name="zero3", strategy=ZERO3),
    dict(name="zero3_configure_model", strategy=ZERO3, compile="configure_model"),
    dict(name="zero3_module", strategy=ZERO3, compile="module"),
    dict(name="zero2_module", strategy={"stage": 2}, compile="module"),
]


def _rel(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return rel_diff(a, b)


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    save = tmp_path_factory.mktemp("lightning_compile")
    cases = [dict(c, save_dir=str(save)) for c in LIGHTNING_CASES]
    reports = launch("lightning_compile.py", 2, {"cases": cases}, timeout=280)
    weights = {c["name"]: torch.load(save / f"{c['name']}.pt") for c in LIGHTNING_CASES
               if (save / f"{c['name']}.pt").exists()}
    return reports, weights


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero3_configure_model", "zero3_module", "zero2_module"])
def test_lightning_compiled_equals_eager_and_ddp(lightning_runs, name):
    reports, weights = lightning_runs
    eager = "zero3" if name.startswith("zero3") else "ddp"
    for rank, rep in enumerate(reports):
        assert "error" not in rep[name], f"rank {rank}: {rep[name].get('trace')}"
        assert rep[name]["compiled"], "the module was not compiled"
        for ref in (eager, "ddp"):
            assert rep[name]["losses"] == pytest.approx(rep[ref]["losses"], rel=TOL), (rank, ref)
    assert _rel(weights[name], weights["ddp"]) <= TOL
    assert _rel(weights[name], weights[eager]) <= TOL


@pytest.fixture(scope="module")
def accelerate_runs():
    runs = {}
    for name, flags in (("eager", ()), ("model", ("--dynamo_backend", "aot_eager")),
                        ("regional", ("--dynamo_backend", "aot_eager", "--dynamo_use_regional_compilation"))):
        with tempfile.TemporaryDirectory(prefix="zs_acc_") as tmp:
            out = Path(tmp)
            reps, _ = accelerate_launch("accelerate_compile.py", {"name": name, "reference": name == "eager"},
                                        timeout=240, out=out, launch_args=flags, use_cpu=False)
            runs[name] = (reps, torch.load(out / f"{name}.pt"),
                          torch.load(out / "ddp.pt") if name == "eager" else None)
    return runs


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["model", "regional"])
@pytest.mark.slow
def test_accelerate_dynamo_backend_equals_eager_and_ddp(accelerate_runs, name):
    eager_reports, eager_weights, ddp_weights = accelerate_runs["eager"]
    reports, weights, _ = accelerate_runs[name]
    for rank, (rep, ref) in enumerate(zip(reports, eager_reports)):
        assert rep["dynamo_backend"] == "AOT_EAGER" and rep["compiled_calls"], rep
        assert ref["dynamo_backend"] == "NO"
        assert rep["losses"] == pytest.approx(ref["losses"], rel=TOL), rank
        assert rep["losses"] == pytest.approx(ref["losses_ddp"], rel=TOL), rank
    assert _rel(weights, eager_weights) <= TOL
    assert _rel(weights, {k: v for k, v in ddp_weights.items()}) <= TOL
