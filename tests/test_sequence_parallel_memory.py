"""At sp 2 a rank's activation memory, measured on the process (peak anonymous RSS of a training
step above the baseline after a warm-up step), is at most half of sp 1's plus 10% (issue 40's
target), for the same 1,024-token sample on 2 ranks; not the engine's own accounting. And the
activation estimate at each SP degree against that measured peak.

tests/workers/sequence_parallel_memory.py. At sp 1 the step must hold at least the fp32 logits
(1,024 x 16,000 x 4 bytes, 62.5 MiB), so the measure sees the activations at all.
"""

from __future__ import annotations

import functools

import pytest

from _launch import launch


@functools.lru_cache(maxsize=None)
def reports() -> list[dict]:
    return launch("sequence_parallel_memory.py", 2, {}, timeout=300)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_ranks_activation_memory_halves_at_sp_2():
    for rank, rep in enumerate(reports()):
        assert rep["peak_sp1"] >= rep["logits_bytes"], rep
        assert rep["peak_sp2"] <= (0.5 + 0.1) * rep["peak_sp1"], (rank, rep["peak_sp2"] / rep["peak_sp1"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sp", [1, 2])
def test_the_activation_estimate_per_sp_degree_predicts_the_process_peak(sp):
    """``estimate_activations(..., sequence_parallel_size=sp).peak_without_checkpointing`` against the
    operating system's count of the step, within 20% (as tests/test_tiled_loss_memory.py): what
    ``zero_auto`` and ``zero-strategy estimate --sp`` say a rank needs is what it takes. The excess
    the estimate does not count is the stage-3 working set (the head's and the embedding's gathered
    weights and gradients: 4 MiB each) and the allocator's."""
    from transformers import LlamaConfig

    from zero_strategy.estimate import estimate_activations

    config = LlamaConfig(vocab_size=16000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    estimate = estimate_activations(config, 1, 1024, "fp32", "sdpa", sequence_parallel_size=sp)
    for rank, rep in enumerate(reports()):
        measured = rep[f"peak_sp{sp}"]
        assert measured == pytest.approx(estimate.peak_without_checkpointing, rel=0.2), (rank, measured, estimate)
