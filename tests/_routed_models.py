"""Models whose ranks use different parameters in a step, in the shapes users write them.

* :class:`RoutedMoELM`: a mixture of experts written the Hugging Face way (each expert a
  block in an ``nn.ModuleList``, a loop over only the experts the batch hits). Every
  sample carries a routing hint that biases the router, so which experts a rank's
  samples reach is fixed by the data: :func:`routed_batch` gives rank 0 experts 0-1 and
  rank 1 experts 2-3 (``disjoint``), or experts 0-1 on every rank (``shared``: 2-3 are
  used by no rank).
* :class:`MoEBlocksLM`: the same experts inside each transformer block.
* :class:`TinyVLM`: a LLaVA-style model whose vision tower (two blocks) and projector
  run only when the batch carries images.
* :class:`AdapterLM`: blocks with an adapter that runs only on some steps.
* The TinyLM of ``_models.py`` with ``depth``: an early exit after some blocks.

The reference for all of them is the plain model trained on the global batch, which
is what DDP with ``find_unused_parameters=True`` computes: a parameter some ranks
used gets the mean with zeros from the others; one no rank used has no gradient.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM, SEQ, EXPERTS = 32, 16, 6, 4


class Expert(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Top-1 routing; the experts the batch does not reach are never called (HF's loop)."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, x, hint):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        bias = 8.0 * nn.functional.one_hot(hint, len(self.experts)).repeat_interleave(t, 0)
        probs = torch.softmax(self.gate(flat) + bias, dim=-1)
        weight, chosen = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        hit = torch.unique(chosen)
        for e in hit.tolist():
            rows = (chosen == e).nonzero().squeeze(-1)
            out = out.index_add(0, rows, self.experts[e](flat[rows]) * weight[rows, None])
        return x + out.reshape(b, t, d)


class RoutedMoELM(nn.Module):
    def __init__(self, dim: int = DIM, experts: int = EXPERTS, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.moe = SparseMoE(dim, experts)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, hint):
        return self.head(self.norm(self.moe(self.embed(tokens), hint)))


class MoEBlock(nn.Module):
    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = SparseMoE(dim, experts)

    def forward(self, x, hint):
        return self.mlp(self.norm(x), hint)


class MoEBlocksLM(nn.Module):
    """Experts inside the transformer blocks (the blocks are the units, the experts a list
    within each): an expert no rank's tokens reach shares its unit with used parameters."""

    def __init__(self, dim: int = DIM, experts: int = EXPERTS, vocab: int = VOCAB, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MoEBlock(dim, experts) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, hint):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, hint)
        return self.head(self.norm(h))


def routed_batch(rank: int, step: int, routing: str = "disjoint", size: int = 4):
    """(tokens, hint, targets) for one rank: hints 2*rank + {0, 1} (disjoint) or {0, 1} (shared)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    base = 2 * rank if routing == "disjoint" else 0
    hint = base + torch.arange(size) % 2
    return tokens, hint, targets


class VisionBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.fc(nn.functional.gelu(self.norm(x)))


class VisionTower(nn.Module):
    def __init__(self, dim: int, patch: int = 4):
        super().__init__()
        self.patch_embed = nn.Linear(patch, dim)
        self.layers = nn.ModuleList(VisionBlock(dim) for _ in range(2))

    def forward(self, pixels):  # [B, P, patch]
        h = self.patch_embed(pixels)
        for layer in self.layers:
            h = layer(h)
        return h


class TextBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class TinyVLM(nn.Module):
    """Image features (when there are images) are prepended to the text embeddings, LLaVA-style."""

    def __init__(self, dim: int = DIM, vocab: int = VOCAB):
        super().__init__()
        self.vision_tower = VisionTower(dim)
        self.projector = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TextBlock(dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, pixel_values=None):
        h = self.embed(tokens)
        if pixel_values is not None:
            h = torch.cat([self.projector(self.vision_tower(pixel_values)), h], dim=1)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))[:, -tokens.shape[1]:]


class AdaptedBlock(TextBlock):
    """A block with an adapter that runs only when the batch asks for it (a task switch)."""

    def __init__(self, dim: int):
        super().__init__(dim)
        self.adapter = nn.Linear(dim, dim)

    def forward(self, x, use_adapter: bool = False):
        x = super().forward(x)
        return x + self.adapter(x) if use_adapter else x


class AdapterLM(nn.Module):
    """Blocks whose adapter shares the block (its unit, and its flat group) with used parameters."""

    def __init__(self, dim: int = DIM, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(AdaptedBlock(dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, use_adapter: bool = False):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, use_adapter)
        return self.head(self.norm(h))


def vlm_batch(rank: int, step: int, images_on: tuple[int, ...] = (0,), size: int = 2):
    """(tokens, pixel_values or None, targets): only the ranks in ``images_on`` get images."""
    g = torch.Generator().manual_seed(2000 * step + rank)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    pixels = torch.randn(size, 3, 4, generator=g) if rank in images_on else None
    return tokens, pixels, targets
