"""benchmarks/sp_bench.py measures what issue 40's targets are judged on.

Two properties of the benchmark's measure, not of the engine:

* The peak comes from the kernel's high-water mark (``PeakMeter``), so a block held for less than a
  millisecond counts in full, and no thread polls beside the step it times (the 5 ms polling thread
  it replaced missed such peaks and took the interpreter's lock from the step 200 times a second).
* The memory ratio of sp N over sp 1 is given twice: on the whole peak, and on the activations alone
  (the peak above the same model's peak at a tiny sequence, which holds the same stage-3 transients);
  a configuration whose activations divide meets the activation target while its whole peak,
  carrying the fixed transient, does not.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sp_bench():
    spec = importlib.util.spec_from_file_location("sp_bench_under_test", ROOT / "benchmarks" / "sp_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_the_peak_counts_a_block_held_for_an_instant(sp_bench):
    import torch

    block = 64 * 2**20
    base = sp_bench._anon()
    meter = sp_bench.PeakMeter()
    held = torch.ones(block // 4)  # touched in full, then freed at once
    del held
    peak = meter.stop() - base
    assert peak >= block - 2**20, f"the peak above the baseline was {peak / 2**20:.1f} MiB, the block 64 MiB"
    assert meter.file_growth < 8 * 2**20


def _row(sp: int, peak: float, floor: float) -> dict:
    return {"system": "zero_strategy", "length": 4096, "sp": sp, "tiled": True, "peak_anon_MiB": peak,
            "step_s": 1.0, "activation_MiB": peak - floor}


def test_the_activation_ratio_leaves_out_what_every_degree_holds(sp_bench):
    # activations 100 / 50 / 25 MiB beside a fixed 16 MiB transient (the head's gathered weight and gradient)
    rows = [_row(1, 116.0, 16.0), _row(2, 66.0, 16.0), _row(4, 41.0, 16.0)]
    ratios = sp_bench.ratios_of(rows)["zero_strategy 4096 tiled sp 4"]
    assert ratios["memory_over_sp1"] == pytest.approx(41 / 116)
    assert not ratios["memory_met"]  # the whole peak: 0.353 > 0.35
    assert ratios["activation_over_sp1"] == pytest.approx(0.25)
    assert ratios["activation_met"]
