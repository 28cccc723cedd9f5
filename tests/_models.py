"""The small model every parity test trains: each feature ZeRO must get right, once.

* tied weights: the output head shares the embedding matrix;
* LayerNorm and biases in every block;
* a frozen parameter (``frozen_mix``, requires_grad=False) used in forward;
* a parameter smaller than any world size we test (``gate``, 1 element);
* two optimizer param groups (decayed weights; undecayed biases/norms) with
  different learning rates and weight decay.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

VOCAB, DIM, SEQ = 37, 24, 8


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.gate = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x):
        return x + self.gate * self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, layers: int = 3, dim: int = DIM, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen_mix = nn.Parameter(torch.randn(dim, dim) * 0.1, requires_grad=False)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.final_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens, depth: int | None = None):
        """``depth``: run only the first ``depth`` blocks (an early exit, out of the usual order)."""
        h = self.embed(tokens)
        h = h + h @ self.frozen_mix
        for block in self.layers[:depth]:
            h = block(h)
        return self.head(self.final_norm(h))


def param_groups(model: nn.Module, lr: float = 3e-3) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    return [dict(params=decay, lr=lr, weight_decay=0.1),
            dict(params=no_decay, lr=2 * lr, weight_decay=0.0)]


def batch(rank: int, step: int, micro: int, size: int = 4):
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    tokens = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return tokens, targets


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_llama_config():
    """A 2-layer Llama with tied embeddings: a real Hugging Face model in milliseconds."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=True)


@contextlib.contextmanager
def saved_storages(model: nn.Module):
    """Under ``with saved_storages(model) as storages:``, every distinct storage a tensor autograd saves
    lives in, the model's parameters excluded, as ``{data_ptr: nbytes}``: what forward keeps alive for
    backward (``sum(storages.values())``), measured through ``saved_tensors_hooks``, without any formula."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield storages


def step_beside(model, opt, ref, ref_opt, batch: dict):
    """One training step of a set-up model and of its reference not set up, on the same Hugging Face
    ``batch``: ``(outputs, want)``, the set-up model's outputs and the reference's loss, for the caller
    to compare."""
    outputs = model(**batch)
    outputs.loss.backward()
    opt.step()
    opt.zero_grad()
    want = ref(**batch).loss
    want.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return outputs, want


def whole_tensor_recipe(model, recipe: str) -> list[torch.optim.Optimizer]:
    """Optimizers that need whole tensors, in the users' idiom. ``"muon"``: torch's Muon docs (2-D hidden
    matrices to Muon, the rest to AdamW, two optimizers); ``"sgd_in_muons_place"``: the same with
    SGD-momentum for Muon (what a ZeRO that skipped Muon's orthogonalization would compute);
    ``"adafactor"``: one Adafactor over :func:`param_groups`; ``"adamw8bit"``: bitsandbytes' 8-bit
    AdamW over them, quantizing every state of 256 elements or more (its default leaves tensors under
    4096 elements in 32 bits, which would be all of this model's)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if recipe in ("muon", "sgd_in_muons_place"):
        hidden = [p for n, p in named if p.ndim == 2 and n.startswith("layers.")]
        rest = [p for n, p in named if not (p.ndim == 2 and n.startswith("layers."))]
        first = (torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01) if recipe == "muon"
                 else torch.optim.SGD(hidden, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01))
        return [first, torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.0)]
    if recipe == "adafactor":
        return [torch.optim.Adafactor(param_groups(model, lr=1e-2))]
    if recipe == "adamw8bit":
        import bitsandbytes as bnb

        return [bnb.optim.AdamW8bit(param_groups(model, lr=1e-2), min_8bit_size=256)]
    raise ValueError(recipe)
