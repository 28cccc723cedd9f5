"""Activation memory of a Llama-style decoder, before running anything (``estimate_activations``).

Re-exported by :mod:`zero_strategy.estimate`; the model-state formulas are there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ._model.tiled_loss import default_chunk_tokens
from .config import ZeroConfigError, _as_dtype_name

#: bytes per element of each dtype name (shared with estimate.py)
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ZeroConfigError(name, f"expected a non-negative number of parameters, got {value!r}",
                              "Pass e.g. 7e9 or an nn.Module.")
    return int(round(value))


# ------------------------------------------------------------------ activations
#
# [Note: activation memory of a Llama-style decoder]
# Activation memory is what autograd saves for backward: the tensors the forward's
# operations keep (``torch.autograd.graph.saved_tensors_hooks`` sees each one), counted
# once per storage. Korthikanti et al. ("Reducing Activation Recomputation in Large
# Transformer Models", 2022, §4.1) count sbh(34 + 5as/h) bytes per GPT layer in 16-bit
# with dropout (s tokens, b sequences, h hidden, a heads). A Hugging Face Llama-style
# layer (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP of width f, no
# dropout) saves, with e the bytes of the compute dtype (bf16 2, fp32 4):
#
#   each RMSNorm (two per layer): the input upcast to fp32 (4sbh; in fp32 the input
#     itself), the normalised tensor cast back (e·sbh, kept by ``weight * x``), its output
#     (e·sbh, kept by the next projections) and rsqrt of the variance (4sb, fp32):
#     (4 + 2e)sbh + 4sb;
#   attention: the rotary q (e·sbh) and, repeated to all heads, k and v (2e·sbh; with one kv head and
#     b = 1 the repeat is a view of it: 2e·sh/a; the rotary
#     multiplications keep only cos/sin, which need no gradient), the output before o_proj
#     (e·sbh); with eager attention also the fp32 softmax (4·as²b) and its cast for the
#     product with v (e·as²b, bf16 only): 4e·sbh + (4 + e')as²b, e' = e below 4 bytes else 0;
#     with SDPA (PyTorch's fused kernel, the HF default) q, k and v at their own head
#     counts (kv heads g: (1 + 2g/a)e·sbh), the output (e·sbh, also o_proj's input) and
#     the fp32 log-sum-exp (4·asb) instead of any s² term;
#   SwiGLU MLP: gate output (kept by SiLU), SiLU output, up output (both kept by the
#     product) and the product (kept by down_proj): 4e·sbf.
#
# Per layer, eager:  sbh(8 + 8e + 4e·f/h) + 8sb + (4 + e')as²b
#            SDPA:   sbh(8 + 6e + 2e·g/a + 4e·f/h) + 8sb + 4asb
# Outside the layers: token ids (8bs, int64), the rotary cos/sin tables (2e·s·h/a: one
# for the batch), the final RMSNorm ((4 + 2e)sbh + 4sb) and the loss: the fp32
# log-softmax of the logits (4bsV), the labels padded by one (8b(s + 1); for b > 1 the
# shifted copy holds 8bs, 8b bytes less) and the loss's fp32 weight sum (4). In bf16 with eager attention and f = 8h/3
# (Llama 2 shape) a layer keeps sbh(45.3 + 6as/h) bytes against GPT's 34 + 5as/h: the
# fp32 upcasts of RMSNorm and softmax and the wider gated MLP cost more than the
# dropout masks they lack. With gradient checkpointing (one checkpoint per layer, as
# ``gradient_checkpointing_enable`` sets) each layer keeps only its input (e·sbh) until
# backward recomputes it, so the peak is L·e·sbh + the outside + one layer's activations.
# test_estimate_activations.py checks both against saved-tensor bytes measured on CPU.
#
# The loss also needs memory it does not keep (``loss_transient``), at the start of backward
# when everything above is still held: the logits (e·bsV, which the model's output holds), and
# in backward the fp32 gradients of the log-softmax and of the logits (8bsV), cast back to the
# logits' dtype below fp32 (e·bsV). On the issue-40 model (fp32, 4,096 tokens, V = 32,000) that
# is 3 copies of the 500 MiB logits beside the saved one: 2.0 GiB, as measured
# (benchmarks/tiled_loss_bench.py). With the tiled loss (``tiled_loss``: chunks of c tokens, by
# default an eighth of the rank's b·s tokens and at most 64 MiB of fp32 logits; See [Note: the tiled
# loss] in _model/tiled_loss.py) autograd saves no logits (4bsV less in ``outside``: the hidden
# states, labels and the head's weight it keeps are saved anyway), and the transient is one chunk's
# logits, recomputed in backward and turned into their own gradient in place: 4cV in fp32; below
# fp32 the logits and their fp32 upcast, then the fp32 gradient and its cast back, are alive
# together ((4 + e)cV), and the head's gradient of one chunk (e·Vh, beside the cast gradient, e·cV)
# is added into the head's gradient summed in fp32 (4Vh; its cast to the compute dtype is the
# gradient itself, a model state, as the untiled head's is). With the tiled MLP (chunks of c'
# tokens of each sequence) a layer's MLP saves nothing of its own (its input is the norm's output,
# counted above), and its backward holds one chunk's four intermediates again (4e·b·c'·f) and,
# below fp32, its three weights' gradients summed in fp32 (12hf): ``mlp_transient``.
#
# Under Ulysses sequence parallelism of degree N (``sequence_parallel_size``; See [Note: sequence
# parallelism] in _model/sequence_parallel.py) a rank holds s' = s_p/N tokens of each sequence (s_p:
# s padded to a multiple of N), so every term outside attention is the formula's at s' (the
# embeddings, norms, MLP, logits, the loss, the layer inputs a checkpoint keeps). Attention runs on
# the whole sequence for a/N heads: SDPA saves q, k, v, its output and the log-sum-exp at a/N heads
# by s_p tokens, which is the formula's at s' with the kv heads g replaced by max(g, N) (fewer kv
# heads than N are repeated to N before the all-to-all), and o_proj keeps its own input (e·bs'h: the
# all-to-all's result, where without SP it is SDPA's output itself, laid out as o_proj reads it); eager saves its fp32 softmax over the whole
# sequence, (a/N)·s_p²·b elements, N times the formula's a·s'²·b. The shard carries its own position
# ids (one rotary table per sequence: 2e·b·s'·h/a) and pre-shifted labels (8bs', no padded copy).
# The all-to-alls save nothing; they hold, for a moment, two copies of the tensor they move beside
# it (the packed chunks and the received ones), and eager is given the whole sequence's causal mask
# (e·s_p²): ``attention_transient``. With activation offload (``activation_offload``, with
# checkpointing; See [Note: activation offload] in _model/activation_offload.py) the L layer inputs
# wait on the host (``host_bytes``) and the device holds one of them again while its layer is
# recomputed.


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes autograd keeps for backward in one forward of ``batch_size`` x ``seq_len`` tokens
    per rank. See [Note: activation memory of a Llama-style decoder]."""

    batch_size: int
    seq_len: int
    layers: int
    precision: str
    attention: str
    per_layer: int      # one decoder layer, no checkpointing
    layer_input: int    # what a checkpointed layer keeps: its input
    outside: int        # token ids, rotary tables, final norm, loss
    rotary: int         # the rotary cos/sin tables (part of ``outside``)
    loss_transient: int = 0  # what the loss holds beyond ``outside`` at the start of backward
    tiled_loss: int | None = None  # chunk tokens of the tiled loss; None: the model's own loss
    mlp_transient: int = 0  # the tiled MLP: one chunk's intermediates while its backward recomputes them
    tiled_mlp: int | None = None  # chunk tokens of the tiled MLP; None: the MLP whole
    sequence_parallel_size: int = 1  # N: this rank holds seq_len / N tokens of each sequence (padded up)
    attention_transient: int = 0  # the all-to-alls' buffers (and eager's whole causal mask) under SP
    activation_offload: bool = False  # the checkpointed layers' inputs wait on the host

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence on this rank: ``seq_len`` padded to a multiple of N, divided by N."""
        return -(-self.seq_len // self.sequence_parallel_size)

    @property
    def _kept_inputs(self) -> int:
        """The checkpointed layers' inputs on the device: one (being recomputed) when offloaded."""
        return self.layer_input if self.activation_offload else self.layers * self.layer_input

    @property
    def host_bytes(self) -> int:
        """What activation offload keeps in host memory: every checkpointed layer's input."""
        return self.layers * self.layer_input if self.activation_offload else 0

    @property
    def without_checkpointing(self) -> int:
        return self.layers * self.per_layer + self.outside

    @property
    def with_checkpointing(self) -> int:
        """Peak with one checkpoint per layer: every layer's input, plus one layer recomputed."""
        return self._kept_inputs + self.outside + self.per_layer

    @property
    def peak_without_checkpointing(self) -> int:
        """Saved activations plus the larger transient: the loss's, a tiled MLP's in backward, or the
        all-to-alls'."""
        return self.without_checkpointing + max(self.loss_transient, self.mlp_transient, self.attention_transient)

    @property
    def peak_with_checkpointing(self) -> int:
        """The larger of the loss's moment (every layer's input, the loss) and one layer's recomputation."""
        inputs = 0 if self.activation_offload else self.layers * self.layer_input
        return max(inputs + self.outside + self.loss_transient,
                   self.with_checkpointing + max(self.mlp_transient, self.attention_transient))

    def peak(self, checkpointing: bool) -> int:
        """Device bytes at the step's worst moment, with or without one checkpoint per layer."""
        return self.peak_with_checkpointing if checkpointing else self.peak_without_checkpointing

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "local_seq_len": self.local_seq_len,
                "without_checkpointing": self.without_checkpointing,
                "with_checkpointing": self.with_checkpointing,
                "peak_without_checkpointing": self.peak_without_checkpointing,
                "peak_with_checkpointing": self.peak_with_checkpointing, "host_bytes": self.host_bytes}


_LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "granite")


def estimate_activations(hf_config: Any, batch_size: int, seq_len: int, precision: str = "bf16",
                         attention: str | None = None, tiled_loss: bool | int = False,
                         tiled_mlp: bool | int = False, sequence_parallel_size: int = 1,
                         activation_offload: bool = False) -> ActivationEstimate:
    """Activation bytes per rank of a Llama-style Hugging Face decoder (``hf_config``: its config).

    ``attention``: ``"eager"`` or ``"sdpa"``; default: the config's ``attn_implementation``
    (``"sdpa"`` when unset, as transformers chooses). Assumes training with
    ``use_cache=False`` (a KV cache would hold k and v of every layer besides). ``tiled_loss``: as
    ``ZeroConfig(tiled_loss=...)`` (True: the default chunk; an int: chunk tokens); ``tiled_mlp``
    likewise (True: chunks of the hidden size in tokens). ``sequence_parallel_size``: N ranks share
    each sequence (``ZeroConfig(sequence_parallel_size=N)``): the bytes are one rank's, holding
    ``seq_len / N`` tokens (``seq_len`` is the whole sequence). ``activation_offload``: the
    checkpointed layers' inputs go to the host (``host_bytes``; it changes only the figures with
    checkpointing).
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _LLAMA_STYLE:
        raise ZeroConfigError("--batch-size", f"the activation formula covers Llama-style decoders "
                              f"({', '.join(_LLAMA_STYLE)}), not model_type {model_type!r}",
                              "Leave out --batch-size/--seq-len for this model (model states only).")
    b, whole = _count("batch_size", batch_size), _count("seq_len", seq_len)
    n = _count("sequence_parallel_size", sequence_parallel_size)
    if n < 1:
        raise ZeroConfigError("--sp", f"must be at least 1, got {sequence_parallel_size!r}",
                              "Pass the sequence-parallel degree, e.g. 2 (1: off).")
    e = _DTYPE_BYTES[_as_dtype_name("precision", precision)]
    h, f, v = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size
    a = hf_config.num_attention_heads
    g = getattr(hf_config, "num_key_value_heads", None) or a
    layers = hf_config.num_hidden_layers
    attention = attention or getattr(hf_config, "_attn_implementation", None) or "sdpa"
    if attention not in ("eager", "sdpa"):
        raise ZeroConfigError("--attention", f"the formula covers eager and sdpa attention, not {attention!r}",
                              "Pass --attention eager or sdpa (flash-attention saves what sdpa does).")
    padded = -(-whole // n) * n
    s = padded // n  # See [Note: activation memory of a Llama-style decoder]: everything outside attention at s'
    sbh, sb = s * b * h, s * b
    norm = (4 + 2 * e) * sbh + 4 * sb
    mlp, mlp_chunk, mlp_transient = 4 * e * s * b * f, None, 0
    if tiled_mlp is not False:  # See [Note: the tiled MLP] in _model/tiled_mlp.py: its input is the norm's output
        mlp_chunk = min(s, h if tiled_mlp is True else _count("tiled_mlp", tiled_mlp))
        mlp, mlp_transient = 0, 4 * e * b * mlp_chunk * f + (12 * h * f if e < 4 else 0)
    kv = max(g, n) if n > 1 else g  # fewer kv heads than N are repeated to N before the all-to-all
    if attention == "eager":  # k and v repeated to the (local) heads; one kv head of one sequence: a view of it
        local_q, local_kv = a // n, max(g, n) // n
        kv_bytes = 2 * e * b * padded * (h // a) * (1 if local_kv == 1 and b == 1 else local_q)
        attn = 2 * e * sbh + kv_bytes + (4 + (e if e < 4 else 0)) * local_q * padded * padded * b
    else:
        attn = (1 + 2 * kv / a) * e * sbh + e * sbh + 4 * a * s * b
        if n > 1:  # o_proj's input is the all-to-all's result, no longer SDPA's output itself
            attn += e * sbh
    attention_transient = 0
    if n > 1:  # two more copies of the largest tensor an all-to-all moves (q); eager's whole mask
        attention_transient = 2 * e * sbh + (e * padded * padded if attention == "eager" else 0)
    # one table for the batch when position ids are (1, s); a shard's own (b, s') ids make one per sequence
    rotary = 2 * e * s * (h // a) * (b if n > 1 else 1)
    labels = 8 * b * s if n > 1 else 8 * b * (s + 1)  # the shard's pre-shifted labels; else padded by one
    below_fp32 = e if e < 4 else 0
    if tiled_loss is False:
        chunk = None
        outside = 8 * b * s + rotary + norm + 4 * b * s * v + labels + 4
        transient = e * b * s * v + 8 * b * s * v + below_fp32 * b * s * v
    else:
        chunk = min(b * s, default_chunk_tokens(v, b * s) if tiled_loss is True else _count("tiled_loss", tiled_loss))
        outside = 8 * b * s + rotary + norm + labels + 4
        if e < 4:
            transient = max((4 + e) * chunk * v, e * chunk * v + e * v * h) + 4 * v * h
        else:
            transient = 4 * chunk * v
    return ActivationEstimate(batch_size=b, seq_len=whole, layers=layers, precision=precision, attention=attention,
                              per_layer=int(2 * norm + attn + mlp), layer_input=e * sbh, outside=outside,
                              rotary=rotary, loss_transient=int(transient), tiled_loss=chunk,
                              mlp_transient=int(mlp_transient), tiled_mlp=mlp_chunk, sequence_parallel_size=n,
                              attention_transient=int(attention_transient),
                              activation_offload=bool(activation_offload))
