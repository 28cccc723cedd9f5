"""Ulysses sequence parallelism on a set-up model: the batch shard, the attention wrapper, the loss.

[Note: sequence parallelism]
``ZeroConfig(sequence_parallel_size=N)`` splits the ranks into SP groups of N
consecutive ranks (_comm/sequence_parallel.py); the N ranks of a group train on the
same sample, each holding 1/N of its sequence, so every activation outside attention
(embeddings, MLPs, norms, logits, the loss) is 1/N as large. ZeRO is untouched: it
still shards over every rank, and the engine sees ordinary data-parallel gradients.

* **Data** (:func:`shard_batch`): every rank of a group reads the same whole sample
  (the data loader is sharded over the data-parallel degree world/N, not the world),
  computes ``shift_labels`` on the whole sequence (so the label of a shard's last token
  is the next shard's first token), pads the sequence to a multiple of N (pad tokens at
  the end, labelled -100: under a causal mask they change no other token), and keeps
  its slice of every per-token tensor, with ``position_ids`` holding the *global*
  positions, so rotary embeddings are right on every shard. ``labels`` is dropped, as
  DeepSpeed's ``UlyssesSPDataLoaderAdapter`` drops it: a shard's own loss would shift
  within the shard and lose the boundary token. Packed sequences (positions restarting
  inside a row) and left padding are refused: the attention below is causal over the
  whole row.
* **Attention** (:func:`ulysses_attention`): the model's own attention function (sdpa,
  eager, flash) is wrapped, not replaced: q, k, v go from ``[b, heads, s/N, d]`` to
  ``[b, heads/N, s, d]`` by an all-to-all, the wrapped function runs on whole sequences
  for a slice of the heads, and the output goes back. Causal masking is the kernel's
  own over the whole sequence (sdpa/flash ``is_causal``; eager gets a full causal mask,
  as it is O(s²) anyway). Grouped-query attention with fewer kv heads than N repeats
  each kv head N/kv times before the all-to-all and hands the wrapped function a view
  of the module whose ``num_key_value_groups`` matches the local heads (the module is
  never changed). Which function it is decides how it is called, not its name
  (``hf.attention_kind``): transformers' sdpa and flash wrappers (``flash_attention_2/3/4`` and
  Hub kernels it registers with its flash wrapper), the model's eager function; anything else is
  refused by name. A flash kernel sees the config under the name it was loaded with: transformers
  imports the kernel by ``config._attn_implementation``, which names the wrapper's registration.
* **Loss and gradients** (:func:`sequence_parallel_loss`): a rank's loss is its shard's
  token-loss sum; the group sums them with a differentiable all-reduce and divides by
  the valid tokens of the whole sample, so every rank of the group holds (and logs) the
  loss one process would compute on the whole sample, and a shard whose labels are all
  -100 adds zero, never NaN. The all-reduce's backward sums the group's gradients, so
  each rank back-propagates N copies of the sample's gradient; over the world that is
  N × (data-parallel ranks) copies, and the engine's average over all ranks gives the
  data-parallel mean. This is the Hugging Face convention (Accelerate's ALST example,
  the Trainer's ``deepspeed_sp_compute_loss``: a differentiable all-gather of the shard
  losses weighted by their tokens, whose backward also sums), so their loops are exact
  here unchanged, and the engine's divisor, clipping, accumulation and offload need
  nothing of their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch

from .._comm.sequence_parallel import (HeadsToSequence, SequenceParallelGroup, SequenceToHeads, SumOverGroup,
                                       gather_sequence, sum_over_group)

__all__ = ["shard_batch", "sequence_parallel_loss", "ulysses_attention", "SequenceShardedLoader",
           "IGNORE_INDEX", "check_heads"]

#: the label that marks a token without loss (transformers' and torch's ignore_index)
IGNORE_INDEX = -100

#: the kinds of attention function the wrapper knows how to call: sdpa and flash take causal masking
#: from the module (``is_causal``) when given no mask; eager needs the mask
KERNEL_KINDS = ("sdpa", "flash", "eager")


def shard_batch(batch: Mapping[str, Any], sp: SequenceParallelGroup, pad_token_id: int = 0) -> dict[str, Any]:
    """This rank's shard of a whole-sample batch; See [Note: sequence parallelism].

    ``batch``: ``input_ids`` [b, s], optional ``labels`` / ``shift_labels`` / ``position_ids``
    / ``attention_mask`` [b, s] and anything else (tensors of shape [b, s, ...] are sharded
    along the sequence, other values are kept as they are). Returns the shard with
    ``position_ids`` (global) and ``shift_labels`` (when labels were given), without
    ``labels`` and ``attention_mask``."""
    if "input_ids" not in batch:
        raise ValueError("sequence parallelism shards batches by their input_ids [batch, seq]; this batch has "
                         f"the keys {sorted(batch)}")
    out = dict(batch)
    input_ids = out["input_ids"]
    b, s = input_ids.shape[:2]
    positions = out.get("position_ids")
    if positions is None:
        positions = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)
    _refuse_packed(positions)
    mask = out.pop("attention_mask", None)
    if mask is not None:
        _refuse_left_padding(mask)
    labels = out.pop("labels", None)
    if labels is not None and "shift_labels" not in out:
        out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    out["position_ids"] = positions
    pad = (-s) % sp.size
    if pad:
        fill = {"input_ids": pad_token_id, "shift_labels": IGNORE_INDEX}
        for key, value in out.items():
            if key == "position_ids":
                out[key] = torch.cat([value, value[:, -1:] + torch.arange(1, pad + 1, device=value.device)], dim=1)
            elif _per_token(value, b, s):
                widths = [0, 0] * (value.dim() - 2) + [0, pad]
                out[key] = torch.nn.functional.pad(value, widths, value=fill.get(key, 0))
    chunk = (s + pad) // sp.size
    # copies: a slice of a [b > 1, s] batch is not contiguous (transformers' loss views shift_labels flat),
    # and a shard of its own does not pin the whole sequence
    return {key: value[:, chunk * sp.rank:chunk * (sp.rank + 1)].clone() if _per_token(value, b, s + pad)
            else value for key, value in out.items()}


def _per_token(value: Any, b: int, s: int) -> bool:
    return torch.is_tensor(value) and value.dim() >= 2 and value.shape[0] in (1, b) and value.shape[1] == s


def _refuse_packed(positions: torch.Tensor) -> None:
    if positions.shape[1] > 1 and not bool((positions[:, 1:] - positions[:, :-1] == 1).all()):
        raise ValueError("sequence parallelism needs position_ids that count up by one along each row (one "
                         "sequence per row, no packing): the attention is causal over the whole row. Unpack the "
                         "sequences (one per row, padded at the end) or train them without sequence parallelism")


def _refuse_left_padding(mask: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"sequence parallelism takes a 2-D attention_mask [batch, seq] (padding only); got "
                         f"shape {tuple(mask.shape)}: drop it, the attention is causal over the whole sequence")
    m = mask.to(torch.int8)
    if bool((m[:, 1:] > m[:, :-1]).any()):
        raise ValueError("sequence parallelism needs padding at the end of each row (attention_mask 1...1 0...0): "
                         "this batch has padding before real tokens. Pad on the right (tokenizer.padding_side = "
                         "'right') with labels of -100 on the padding")


def sequence_parallel_loss(loss: torch.Tensor, shift_labels: torch.Tensor, sp: SequenceParallelGroup) -> torch.Tensor:
    """The whole sample's mean token loss on every rank of the group, from this shard's mean
    ``loss`` over its valid ``shift_labels``; See [Note: sequence parallelism]."""
    if sp.size == 1:
        return loss
    valid = (shift_labels != IGNORE_INDEX).sum()
    local = torch.where(valid > 0, loss * valid, torch.zeros_like(loss))  # a shard of -100 only: 0, not NaN
    total = sum_over_group(valid, sp)
    return SumOverGroup.apply(local, sp) / total.clamp(min=1).to(local.dtype)


def check_heads(heads: int, kv_heads: int, n: int, where: str = "") -> None:
    """Refuse head counts the all-to-all cannot split over ``n`` ranks, naming the fix."""
    if heads % n:
        raise ValueError(f"sequence_parallel_size={n} must divide the number of attention heads ({heads}{where}); "
                         f"choose a sequence_parallel_size that divides {heads}")
    if (kv_heads >= n and kv_heads % n) or (kv_heads < n and n % kv_heads):
        raise ValueError(f"sequence_parallel_size={n} and {kv_heads} key/value heads{where}: the kv heads must be "
                         f"a multiple of it, or divide it (then each is repeated); choose a sequence_parallel_size "
                         f"that divides or is a multiple of {kv_heads}")


class _GroupsView:
    """The attention module as the wrapped kernel should see it after the all-to-all: the same
    module, with ``num_key_value_groups`` of the local heads (the module itself is untouched)."""

    def __init__(self, module, groups: int, config=None):
        self._module = module
        self.num_key_value_groups = groups
        if config is not None:
            self.config = config

    def __getattr__(self, name: str):
        return getattr(self._module, name)


class _ConfigView:
    """The model's config as transformers' flash-attention wrapper reads it: under the name of the
    kernel it was loaded with (``_attn_implementation``, which it imports the kernel by), not the
    name the wrapper is registered under."""

    def __init__(self, config, impl: str):
        self._config = config
        self._attn_implementation = impl

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def ulysses_attention(base: Callable, base_name: str, sp: SequenceParallelGroup, kind: str | None = None) -> Callable:
    """``base`` (a transformers attention function registered as ``base_name``) run on whole
    sequences for 1/N of the heads. ``kind``: which of :data:`KERNEL_KINDS` ``base`` is (default:
    read off ``base_name``); a flash kernel sees the config under ``base_name``."""
    kind = kind or ("eager" if base_name == "eager" else "sdpa" if base_name.startswith("sdpa") else "flash")
    if kind not in KERNEL_KINDS:
        raise ValueError(f"attention kind {kind!r}: expected one of {KERNEL_KINDS}")
    causal_without_mask = kind != "eager"

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        n = sp.size
        heads, kv_heads = query.shape[1], key.shape[1]
        check_heads(heads, kv_heads, n)
        if kv_heads < n:  # See [Note: sequence parallelism]: replicate kv heads
            key = key.repeat_interleave(n // kv_heads, dim=1)
            value = value.repeat_interleave(n // kv_heads, dim=1)
        q = SequenceToHeads.apply(query, sp)    # [b, h/N, s, d]
        k = SequenceToHeads.apply(key, sp)      # [b, kv'/N, s, d]
        v = SequenceToHeads.apply(value, sp)
        groups = q.shape[1] // k.shape[1]
        config = None
        if kind == "flash" and hasattr(module, "config"):
            config = _ConfigView(module.config, base_name)
        same = getattr(module, "num_key_value_groups", groups) == groups and config is None
        view = module if same else _GroupsView(module, groups, config)
        if causal_without_mask:
            mask = None
        else:
            mask = _causal_mask(q.shape[2], q.dtype, q.device)
        if kind == "flash" and torch.is_tensor(kwargs.get("position_ids")):
            kwargs["position_ids"] = gather_sequence(kwargs["position_ids"], sp)
        out, _ = base(view, q, k, v, mask, *args, **kwargs)             # [b, s, h/N, d]
        out = HeadsToSequence.apply(out.transpose(1, 2), sp)           # [b, h, s/N, d]
        return out.transpose(1, 2).contiguous(), None                  # [b, s/N, h, d]

    attention.__name__ = f"ulysses_{base_name}"
    return attention


def _causal_mask(s: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, s, s] additive causal mask (0 on and below the diagonal, the dtype's min above)."""
    mask = torch.full((s, s), torch.finfo(dtype).min, dtype=dtype, device=device).triu_(1)
    return mask.view(1, 1, s, s)


class SequenceShardedLoader:
    """Wraps a data loader that yields whole samples (the same on every rank of an SP group)
    so that it yields this rank's shard (:func:`shard_batch`); everything else (``len``,
    ``set_epoch``, ``batch_size``, ...) is the wrapped loader's."""

    def __init__(self, loader: Iterable, sp: SequenceParallelGroup, pad_token_id: int = 0):
        self.loader, self.sp, self.pad_token_id = loader, sp, pad_token_id

    def __iter__(self):
        for batch in self.loader:
            yield shard_batch(batch, self.sp, self.pad_token_id)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        if name in ("loader", "sp", "pad_token_id"):
            raise AttributeError(name)
        return getattr(self.loader, name)
