"""With the tiled loss no tensor of the full sequence by the full vocabulary exists: the process shows it.

One rank, stage 3, the issue's model (2-layer Llama, hidden 32) with half its vocabulary (16,000
tokens, not 32,000: every quantity the bounds compare scales with the vocabulary, and the step costs
half) at 2,048 tokens: the fp32 logits of the sequence are L = seq x vocab x 4 bytes = 125 MiB, trained
by the HF idiom ``outputs = model(**batch); outputs.loss.backward()``. Measured by the
operating system, not by the engine: the growth of the process's anonymous RSS during one step
(tests/workers/tiled_loss_memory.py). The untiled step holds several copies of the logits (the
head's output, held by ``outputs``; the log-softmax autograd keeps; their two gradients): its growth is above 2 L, which is
what shows this measurement sees them (measured: 4.1 L). The tiled step, with chunks of 128 tokens
(8 MiB of logits), must stay under L / 2 = 62.5 MiB (measured: 0.17 L): a single whole copy of the logits (125 MiB)
would break that bound, and what it holds beyond the chunk (the head's gathered weight and its
gradient, 2 MiB each, the model's activations) fits under it. (At 8,000 tokens the fixed activations
weigh more: 0.25 L, too near the bound.)
Both losses are equal.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from _launch import launch  # noqa: E402

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")]

SEQ, VOCAB = 2048, 16000
LOGITS = SEQ * VOCAB * 4


@functools.lru_cache(maxsize=None)
def report() -> dict:
    return launch("tiled_loss_memory.py", 1, {"seq": SEQ, "vocab": VOCAB, "chunk": 128}, timeout=400)[0]


def test_the_untiled_step_holds_copies_of_the_whole_logits():
    assert report()["untiled"]["growth"] > 2 * LOGITS, report()


def test_the_tiled_step_never_holds_the_whole_logits():
    assert report()["tiled"]["growth"] < LOGITS / 2, report()


def test_both_give_the_same_loss():
    tiled, untiled = report()["tiled"]["losses"], report()["untiled"]["losses"]
    assert tiled == pytest.approx(untiled, rel=1e-5)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_the_activation_estimate_predicts_the_step_s_growth(tiled):
    """``estimate_activations(...).peak_without_checkpointing`` (the saved activations and the loss's
    transient, See [Note: activation memory of a Llama-style decoder]) plus the stage-3 working set of
    the head during the loss's backward (its gathered weight and its whole gradient, 2 x 4·V·h bytes:
    model states, See [Note: the estimated working set] in _estimate_working_set.py) against the
    operating system's count, within 20%: what zero_auto is given must be what the process will take.
    The tiled step's chunk (4·c·V, 8 MiB) is now near the head's 4 MiB, which must be counted."""
    from transformers import LlamaConfig

    from zero_strategy.estimate import estimate_activations

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    estimate = estimate_activations(config, 1, SEQ, "fp32", "sdpa", tiled_loss=128 if tiled else False)
    head_working_set = 2 * 4 * VOCAB * config.hidden_size
    measured = report()["tiled" if tiled else "untiled"]["growth"]
    assert measured == pytest.approx(estimate.peak_without_checkpointing + head_working_set, rel=0.2), \
        (measured, estimate)
