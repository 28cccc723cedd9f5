"""The one relative difference the tests and workers judge results by.

``rel(a, b) = |a - b| / max(|b|, 1e-12)`` for numbers; for a tensor, the largest entry's
difference over the reference's largest magnitude, ``max|a - b| / max(max|b|, 1e-12)``; for
two state dicts, the worst tensor over the reference's keys. ``b`` / ``ref`` is the reference.

Where the suite had six copies of this they differed in small ways; this one takes the
strictest of each, so no test got looser:

* computed in float64 (some copies subtracted in float32, or in the tensors' own dtype:
  bf16 rounding could hide a difference);
* every tensor of the reference is compared, integer and bool buffers too (one copy
  skipped non-floating tensors);
* a NaN anywhere is an infinite difference (``max`` over Python floats, as the copies
  used, silently drops a NaN);
* tensors of different shapes fail (a broadcast subtraction would compare wrongly) and
  an empty reference dict fails (a comparison of nothing says nothing).
"""

from __future__ import annotations

import math

EPS = 1e-12  # the denominator's floor: a reference tensor of zeros is compared absolutely


def rel(a: float, b: float) -> float:
    """``|a - b| / max(|b|, 1e-12)``; NaN on either side is ``inf``."""
    d = abs(a - b) / max(abs(b), EPS)
    return math.inf if math.isnan(d) else d


def tensor_rel_diff(a, b) -> float:
    """``max|a - b| / max(max|b|, 1e-12)`` in float64; ``inf`` where NaN appears."""
    if tuple(a.shape) != tuple(b.shape):
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs reference {tuple(b.shape)}")
    if b.numel() == 0:
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    d = (a - b).abs().max().item() / max(b.abs().max().item(), EPS)
    return math.inf if math.isnan(d) else d


def worst_rel_diff(got: dict, ref: dict) -> tuple[float, str]:
    """The largest :func:`tensor_rel_diff` over ``ref``'s keys, and that tensor's name."""
    assert ref, "nothing to compare: the reference state dict is empty"
    worst, worst_name = -1.0, ""
    for name, want in ref.items():
        if name not in got:
            raise AssertionError(f"{name} of the reference is missing")
        d = tensor_rel_diff(got[name], want)
        if d > worst:
            worst, worst_name = d, name
    return worst, worst_name


def rel_diff(got: dict, ref: dict) -> float:
    """:func:`worst_rel_diff`'s value alone."""
    return worst_rel_diff(got, ref)[0]
