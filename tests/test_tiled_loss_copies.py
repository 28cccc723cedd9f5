"""How much of one chunk's logits the tiled loss holds, and that its chunk shrinks with the tokens it is given.

The oracle counts, op by op (a ``TorchDispatchMode``), the bytes of live tensors of one chunk's logits
(chunk x vocab elements) during the forward and backward of one loss; the same count over autograd
through ``F.cross_entropy`` on one chunk (the tiled loss's former backward, and the shape of
DeepSpeed's ``TiledFusedLogitsLoss`` per shard) shows it sees the copies autograd keeps. fp32: one
fp32 copy of the chunk at a time; bf16: the logits and their fp32 upcast (or the fp32 gradient and
its cast back) together, 6 bytes a logit. See [Note: the tiled loss] in
src/zero_strategy/_model/tiled_loss.py. Issue 40: under sequence parallelism a rank given 1/N of the
tokens must hold 1/N of the loss's memory, which a chunk of a fixed number of tokens larger than
the rank's shard did not.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zero_strategy as zs
from zero_strategy._model.tiled_loss import DEFAULT_CHUNK_BYTES, default_chunk_tokens

VOCAB, HIDDEN, TOKENS = 1000, 16, 64
CHUNK = default_chunk_tokens(VOCAB, TOKENS)  # an eighth of 64 tokens: 8


class LiveChunks(TorchDispatchMode):
    """The most bytes that tensors of exactly ``numel`` elements held at once, and the largest tensor seen."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.refs, self.peak, self.largest = numel, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
                if t.numel() == self.numel:
                    storage = t.untyped_storage()
                    self.refs.setdefault(storage.data_ptr(), []).append((weakref.ref(t), storage.nbytes()))
        alive = 0
        for key, refs in list(self.refs.items()):
            refs[:] = [(ref, size) for ref, size in refs if ref() is not None]
            alive += refs[0][1] if refs else 0
            if not refs:
                del self.refs[key]
        self.peak = max(self.peak, alive)
        return out


def _inputs(dtype):
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype)
    hidden = torch.randn(1, TOKENS, HIDDEN, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, TOKENS))
    return head, hidden, labels


@pytest.mark.parametrize("dtype,bytes_a_logit", [(torch.float32, 4), (torch.bfloat16, 6)], ids=["fp32", "bf16"])
def test_the_tiled_loss_holds_one_chunk_of_logits_at_a_time(dtype, bytes_a_logit):
    head, hidden, labels = _inputs(dtype)
    with LiveChunks(CHUNK * VOCAB) as count:
        zs.tiled_causal_lm_loss(head, hidden, labels).backward()
    assert count.peak == bytes_a_logit * CHUNK * VOCAB, count.peak
    assert count.largest < TOKENS * VOCAB  # the whole logits never


def test_the_count_sees_what_autograd_through_one_chunk_keeps():
    head, hidden, labels = _inputs(torch.float32)
    with LiveChunks(CHUNK * VOCAB) as count:
        logits = head(hidden[0, :CHUNK]).float()
        F.cross_entropy(logits, labels[0, :CHUNK], reduction="sum").backward()
    assert count.peak >= 3 * 4 * CHUNK * VOCAB, count.peak


@pytest.mark.parametrize("vocab", [32000, 128256])
def test_the_default_chunk_divides_with_the_tokens_a_rank_is_given(vocab):
    """Up to 8 chunks of the byte budget: past them the chunk is the budget, the same at every degree."""
    budget = DEFAULT_CHUNK_BYTES // (4 * vocab)
    for tokens in (64, 1000, 4 * budget, 8 * budget):
        whole = default_chunk_tokens(vocab, tokens)
        assert whole * 4 * vocab <= DEFAULT_CHUNK_BYTES
        for n in (2, 4, 8):
            assert default_chunk_tokens(vocab, tokens // n) <= -(-whole // n), (tokens, n)
    assert default_chunk_tokens(vocab, 10**6) == budget  # long sequences: the byte budget
