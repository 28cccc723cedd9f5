"""At sp 2 a rank's activation memory, measured on the process (peak anonymous RSS of a training
step above the baseline after a warm-up step), is at most half of sp 1's plus 10% (issue 40's
target), for the same 1,024-token sample on 2 ranks; not the engine's own accounting.

tests/workers/sequence_parallel_memory.py. At sp 1 the step must hold at least the fp32 logits
(1,024 x 16,000 x 4 bytes, 62.5 MiB), so the measure sees the activations at all.
"""

from __future__ import annotations

import pytest

from _launch import launch


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_ranks_activation_memory_halves_at_sp_2():
    for rank, rep in enumerate(launch("sequence_parallel_memory.py", 2, {}, timeout=300)):
        assert rep["peak_sp1"] >= rep["logits_bytes"], rep
        assert rep["peak_sp2"] <= (0.5 + 0.1) * rep["peak_sp1"], (rank, rep["peak_sp2"] / rep["peak_sp1"])
