"""Accelerate's own loop with torch's Muon recipe (two optimizers, both prepared) under
ZeroAccelerator equals stock Accelerate on DDP at stages 1-3 and with CPU offload (issue 24).

2 CPU processes under ``accelerate launch`` (tests/workers/accelerate_owned.py). Both sides run
Muon's Newton-Schulz in bf16 on the same averaged gradient, so the tolerance is DDP's own
float noise (1e-5 relative), not the ~6e-3 that separates DDP from one process (see
tests/test_owned_optimizers.py). SGD-momentum in Muon's place must land far from it: a ZeRO
that skipped the orthogonalization (DeepSpeed's silent fallback) would fail here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")

from _accelerate_launch import accelerate_launch  # noqa: E402

pytestmark = pytest.mark.multiprocess

PRESETS = ("zero1", "zero2", "zero3", "zero2_offload")
TOL = 1e-5


@pytest.fixture(scope="module")
def reports():
    reports, _ = accelerate_launch("accelerate_owned.py", {})
    return reports


def rel_diff(a: list[float], b: list[float]) -> float:
    a, b = torch.tensor(a), torch.tensor(b)
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("preset", PRESETS)
def test_muon_and_adamw_through_prepare_equal_stock_accelerate(reports, preset):
    for rank, rep in enumerate(reports):
        assert rel_diff(rep[preset]["weights"], rep["stock"]["weights"]) <= TOL, (rank, preset)
        assert "owned" in rep[preset]["layouts"], rep[preset]["layouts"]  # Muon's matrices kept whole


def test_sgd_in_muons_place_lands_elsewhere(reports):
    for rep in reports:
        assert rel_diff(rep["zero2_sgd"]["weights"], rep["stock"]["weights"]) > 100 * TOL
        assert rel_diff(rep["zero2"]["weights"], rep["stock"]["weights"]) <= TOL
