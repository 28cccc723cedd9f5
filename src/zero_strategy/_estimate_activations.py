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
#   attention: the rotary q (e·sbh) and, repeated to all heads, k and v (2e·sbh; the rotary
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
# (benchmarks/tiled_loss_bench.py). With the tiled loss (``tiled_loss``: chunks of c tokens;
# See [Note: the tiled loss] in _model/tiled_loss.py) autograd saves no logits (4bsV less in
# ``outside``: the hidden states, labels and the head's weight it keeps are saved anyway), and
# the transient is one chunk's: the recomputed logits (e·cV, and their fp32 upcast 4cV below
# fp32), the log-softmax (4cV), its two fp32 gradients (8cV) and their cast (e·cV below fp32),
# plus, below fp32, the head's gradient summed in fp32 (4Vh; its cast to the compute dtype is the
# gradient itself, a model state, as the untiled head's is). With the tiled MLP (chunks of c'
# tokens of each sequence) a layer's MLP saves nothing of its own (its input is the norm's output,
# counted above), and its backward holds one chunk's four intermediates again (4e·b·c'·f) and,
# below fp32, its three weights' gradients summed in fp32 (12hf): ``mlp_transient``.


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

    @property
    def without_checkpointing(self) -> int:
        return self.layers * self.per_layer + self.outside

    @property
    def with_checkpointing(self) -> int:
        """Peak with one checkpoint per layer: every layer's input, plus one layer recomputed."""
        return self.layers * self.layer_input + self.outside + self.per_layer

    @property
    def peak_without_checkpointing(self) -> int:
        """Saved activations plus the larger transient: the loss's, or a tiled MLP's in backward."""
        return self.without_checkpointing + max(self.loss_transient, self.mlp_transient)

    @property
    def peak_with_checkpointing(self) -> int:
        """The larger of the loss's moment (every layer's input, the loss) and one layer's recomputation."""
        return max(self.layers * self.layer_input + self.outside + self.loss_transient,
                   self.with_checkpointing + self.mlp_transient)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "without_checkpointing": self.without_checkpointing,
                "with_checkpointing": self.with_checkpointing,
                "peak_without_checkpointing": self.peak_without_checkpointing,
                "peak_with_checkpointing": self.peak_with_checkpointing}


_LLAMA_STYLE = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "granite")


def estimate_activations(hf_config: Any, batch_size: int, seq_len: int, precision: str = "bf16",
                         attention: str | None = None, tiled_loss: bool | int = False,
                         tiled_mlp: bool | int = False) -> ActivationEstimate:
    """Activation bytes per rank of a Llama-style Hugging Face decoder (``hf_config``: its config).

    ``attention``: ``"eager"`` or ``"sdpa"``; default: the config's ``attn_implementation``
    (``"sdpa"`` when unset, as transformers chooses). Assumes training with
    ``use_cache=False`` (a KV cache would hold k and v of every layer besides). ``tiled_loss``: as
    ``ZeroConfig(tiled_loss=...)`` (True: the default chunk; an int: chunk tokens); ``tiled_mlp``
    likewise (True: chunks of the hidden size in tokens).
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in _LLAMA_STYLE:
        raise ZeroConfigError("--batch-size", f"the activation formula covers Llama-style decoders "
                              f"({', '.join(_LLAMA_STYLE)}), not model_type {model_type!r}",
                              "Leave out --batch-size/--seq-len for this model (model states only).")
    b, s = _count("batch_size", batch_size), _count("seq_len", seq_len)
    e = _DTYPE_BYTES[_as_dtype_name("precision", precision)]
    h, f, v = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size
    a = hf_config.num_attention_heads
    g = getattr(hf_config, "num_key_value_heads", None) or a
    layers = hf_config.num_hidden_layers
    attention = attention or getattr(hf_config, "_attn_implementation", None) or "sdpa"
    if attention not in ("eager", "sdpa"):
        raise ZeroConfigError("--attention", f"the formula covers eager and sdpa attention, not {attention!r}",
                              "Pass --attention eager or sdpa (flash-attention saves what sdpa does).")
    sbh, sb = s * b * h, s * b
    norm = (4 + 2 * e) * sbh + 4 * sb
    mlp, mlp_chunk, mlp_transient = 4 * e * s * b * f, None, 0
    if tiled_mlp is not False:  # See [Note: the tiled MLP] in _model/tiled_mlp.py: its input is the norm's output
        mlp_chunk = min(s, h if tiled_mlp is True else _count("tiled_mlp", tiled_mlp))
        mlp, mlp_transient = 0, 4 * e * b * mlp_chunk * f + (12 * h * f if e < 4 else 0)
    if attention == "eager":
        attn = 4 * e * sbh + (4 + (e if e < 4 else 0)) * a * s * s * b
    else:
        attn = (1 + 2 * g / a) * e * sbh + e * sbh + 4 * a * s * b
    rotary = 2 * e * s * (h // a)  # one table for the batch: position ids are (1, s)
    below_fp32 = e if e < 4 else 0
    if tiled_loss is False:
        chunk = None
        outside = 8 * b * s + rotary + norm + 4 * b * s * v + 8 * b * (s + 1) + 4
        transient = e * b * s * v + 8 * b * s * v + below_fp32 * b * s * v
    else:
        chunk = min(b * s, default_chunk_tokens(v) if tiled_loss is True else _count("tiled_loss", tiled_loss))
        outside = 8 * b * s + rotary + norm + 8 * b * (s + 1) + 4
        transient = ((e + below_fp32 + (4 if e < 4 else 0) + 12) * chunk * v
                     + (4 if e < 4 else 0) * v * h)
    return ActivationEstimate(batch_size=b, seq_len=s, layers=layers, precision=precision, attention=attention,
                              per_layer=int(2 * norm + attn + mlp), layer_input=e * sbh, outside=outside,
                              rotary=rotary, loss_transient=int(transient), tiled_loss=chunk,
                              mlp_transient=int(mlp_transient), tiled_mlp=mlp_chunk)
