"""On gloo a gather writes straight into its output (See [Note: gloo's all-gather holds its
output twice] in _comm/gloo_gathers.py).

Three gloo ranks (tests/workers/gloo_gathers.py) gather shards whose values name their rank
and element, so the whole is known without a collective: ``Collectives.all_gather`` (fp32,
bf16, int64; the shard its own tensor or a view of the output's slot), ``pieces_to`` (each
rank's shard cut into pieces, received into separate tensors on one rank) and ``gather_to``,
each to every rank in turn, on the world group and on a subgroup of global ranks 1 and 2
(whose group ranks differ from the global ones). And what a 48 MiB all-gather holds beyond
its output: torch's gloo all-gather held a second buffer of the output's size (measured
48 MiB on each rank, torch 2.13); the broadcasts hold none.
"""

from __future__ import annotations

import functools

import pytest

from _launch import launch

pytestmark = pytest.mark.multiprocess


@functools.lru_cache(maxsize=1)
def reports() -> tuple[dict, ...]:
    return tuple(sorted(launch("gloo_gathers.py", 3, {}, timeout=180), key=lambda r: r["rank"]))


def test_all_gather_is_exact_in_every_dtype_and_size():
    for rep in reports():
        bad = [k for k, ok in rep["all_gather"].items() if not ok]
        assert not bad, f"rank {rep['rank']}: wrong values for {bad}"


def test_pieces_land_in_the_receiving_ranks_tensors():
    for rep in reports():
        assert all(rep["pieces"]), f"rank {rep['rank']}: {rep['pieces']} (one entry per receiving rank)"
        assert all(rep["gather_to"]), f"rank {rep['rank']}: {rep['gather_to']}"


def test_a_subgroup_gathers_by_its_own_ranks():
    sub = [rep for rep in reports() if "sub" in rep]
    assert [rep["rank"] for rep in sub] == [1, 2]
    for rep in sub:
        assert all(rep["sub"]["all_gather"].values()), rep["sub"]["all_gather"]
        assert all(rep["sub"]["pieces"]) and all(rep["sub"]["gather_to"]), rep["sub"]


def test_an_all_gather_holds_nothing_beyond_its_output():
    for rep in reports():
        m = rep["memory"]
        assert m["exact"]
        assert m["grown"] < m["output_bytes"] // 4, (
            f"rank {rep['rank']}: the process grew {m['grown'] / 2**20:.1f} MiB during an all-gather into a "
            f"{m['output_bytes'] / 2**20:.0f} MiB output it already held (a second buffer of the output's size?)")
