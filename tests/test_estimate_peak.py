"""``MemoryEstimate``'s peak is its resting model states plus the working set, each byte once.

Oracle, by hand, for Ψ = 10⁹ bf16 parameters in units of u = 10⁷ (root r = 10⁸), N = 1 (no
padding), Adam ([Note: the estimated working set]):

* stage 1: the gradient buckets are the full gradient 2Ψ, which the ZeRO formula already
  holds as resting gradients: the peak is the resting 16Ψ;
* stage 2: + buckets 2(r + 5u);
* stage 3: + the window 2(r + 2u) and the buckets;
* NVMe at stage 3 (both): the staging pool of max(4, 1 + 4, (1 + 2) + 1 + 4) = 8 slots of 64 MiB
  and the 2-slot upload ring (2 x 64 MiB) against the formula's resting 2 x 4 x 64 MiB: the
  larger figure once.
"""

from __future__ import annotations

import json

from zero_strategy import estimate_memory
from zero_strategy.estimate import UnitSizes, format_table

PSI, R, U = 10**9, 10**8, 10**7
UNITS = UnitSizes(root=R, largest=U, count=90)
MIB = 2**20


def test_stage_1_counts_its_full_gradient_once():
    est = estimate_memory(PSI, stage=1, units=UNITS)
    assert est.working_set_grad_buckets == 2 * PSI == est.device_grads
    assert est.peak_device == est.total_device == 16 * PSI


def test_stages_2_and_3_add_buckets_and_window():
    two = estimate_memory(PSI, stage=2, units=UNITS)
    assert (two.working_set_gathered, two.working_set_grad_buckets) == (0, 2 * (R + 5 * U))
    assert two.peak_device == two.total_device + 2 * (R + 5 * U)
    three = estimate_memory(PSI, stage=3, units=UNITS)
    assert three.working_set_device == 2 * (R + 2 * U) + 2 * (R + 5 * U)
    assert three.peak_device == 16 * PSI + three.working_set_device


def test_nvme_staging_is_counted_once_at_its_larger_figure():
    est = estimate_memory(PSI, stage=3, offload_optimizer="nvme", offload_params="nvme", units=UNITS)
    assert est.host_staging == 2 * 4 * 64 * MIB
    assert est.working_set_staging == 8 * 64 * MIB + 2 * 64 * MIB
    assert est.peak_host == est.total_host - est.host_staging + est.working_set_staging


def test_without_units_the_unit_terms_are_none_and_said_so():
    est = estimate_memory(PSI, stage=3)
    assert est.working_set_gathered is None and est.peak_device is None
    assert "n/a (needs the model)" in str(est)
    assert "n/a: needs the model's unit sizes" in format_table(estimate_memory(PSI))
    assert estimate_memory(PSI, stage=0, units=UNITS).peak_device is None  # DDP: not this engine


def test_to_dict_and_str_carry_the_peak():
    est = estimate_memory(PSI, stage=3, units=UNITS)
    data = json.loads(json.dumps(est.to_dict()))
    assert data["peak_device"] == est.peak_device and data["working_set_device"] == est.working_set_device
    assert "peak with the working set" in str(est)
