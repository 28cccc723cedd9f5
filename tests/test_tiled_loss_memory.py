"""With the tiled loss no tensor of the full sequence by the full vocabulary exists: the process shows it.

One rank, stage 3, the issue's model (2-layer Llama, hidden 32, 32,000-token vocabulary) at 2,048
tokens: the fp32 logits of the sequence are L = seq x vocab x 4 bytes = 250 MiB. Measured by the
operating system, not by the engine: the growth of the process's anonymous RSS during one step
(tests/workers/tiled_loss_memory.py). The untiled step holds several copies of the logits (the
head's output, the log-softmax autograd keeps, their gradients): its growth is above 2 L, which is
what shows this measurement sees them. The tiled step, with chunks of 128 tokens (16 MiB of
logits), must stay under L / 2: a single whole copy of the logits would break that bound, and what
it holds beyond the chunks (the head's gradient, 4 MiB, the model's activations) fits under it.
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

SEQ, VOCAB = 2048, 32000
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
