"""The one relative difference the suite judges results by (tests/_compare.py), as a specification:
the reference is the denominator, and nothing a comparison should catch slips through."""

from __future__ import annotations

import math

import pytest
import torch

from _compare import rel, rel_diff, tensor_rel_diff, worst_rel_diff


def test_numbers_differ_relative_to_the_reference():
    assert rel(1.01, 1.0) == pytest.approx(0.01)
    assert rel(1.0, 1.01) == pytest.approx(0.01 / 1.01)
    assert rel(1e-13, 0.0) == pytest.approx(0.1)  # a zero reference: compared against 1e-12
    assert rel(float("nan"), 1.0) == math.inf


def test_a_tensor_differs_by_its_worst_entry_over_the_reference_largest_magnitude():
    ref = torch.tensor([4.0, -8.0, 1.0])
    got = torch.tensor([4.0, -8.0, 1.5])
    assert tensor_rel_diff(got, ref) == pytest.approx(0.5 / 8)


def test_differences_are_computed_in_float64():
    ref = torch.tensor([1.0], dtype=torch.float32)
    got = ref + 1e-7  # one fp32 ulp near 1 is 1.19e-7
    assert tensor_rel_diff(got, ref) > 0
    ref_bf16 = torch.tensor([256.0], dtype=torch.bfloat16)
    assert tensor_rel_diff(torch.tensor([257.0]), ref_bf16) == pytest.approx(1 / 256)  # bf16 subtraction: 0


def test_nan_shape_mismatch_and_an_empty_reference_fail():
    assert tensor_rel_diff(torch.tensor([float("nan")]), torch.tensor([1.0])) == math.inf
    assert rel_diff({"w": torch.tensor([1.0, float("nan")])}, {"w": torch.tensor([1.0, 1.0])}) == math.inf
    with pytest.raises(AssertionError, match="shapes differ"):
        tensor_rel_diff(torch.ones(1), torch.ones(3))
    with pytest.raises(AssertionError, match="empty"):
        rel_diff({"w": torch.ones(1)}, {})
    with pytest.raises(AssertionError, match="missing"):
        rel_diff({}, {"w": torch.ones(1)})


def test_state_dicts_differ_by_their_worst_tensor_integer_buffers_included():
    ref = {"a": torch.ones(3), "steps": torch.tensor(4), "b": torch.full((2,), 2.0)}
    got = {"a": torch.ones(3), "steps": torch.tensor(5), "b": torch.full((2,), 2.0), "extra": torch.zeros(1)}
    assert worst_rel_diff(got, ref) == (pytest.approx(0.25), "steps")
    assert worst_rel_diff(ref, ref) == (0.0, "a")
