"""The one module that knows bitsandbytes' quantized parameters: a QLoRA base under ZeRO.

bitsandbytes is never imported here (nor anywhere in the package below the front ends): a
model holds its parameters only if the user built it with them, so they are recognized by
their class and the attributes bitsandbytes gives them (``Params4bit.quant_state``,
``Int8Params``), as _model/hf.py recognizes transformers' models.

[Note: packed 4-bit parameters under ZeRO]
A 4-bit base (``BitsAndBytesConfig(load_in_4bit=True, ...)``) holds each quantized weight as a
``Params4bit``: the packed codes, two 4-bit values per byte, in a 2-D ``[n, 1]`` tensor of the
*storage* dtype (``bnb_4bit_quant_storage``: uint8 by default, bf16/fp16/fp32 as FSDP recipes
pass them, so four or eight codes share one element), and a ``quant_state`` attribute on the
same Python object (absmax per block, the code book, the original shape and dtype; with double
quantization a nested state). bnb's matmul reads both: the packed bytes as they were written,
bit for bit, and the state from the parameter object itself.

* Whatever the storage dtype (uint8 by default, bf16/fp16/fp32), the packed codes are frozen, so
  they go into a frozen flat group like any other frozen weight, but in **their own storage
  dtype** (``kept_dtypes``: See [Note: parameters kept in fp32] in _engine/units.py), never cast to
  the compute dtype: a cast reads the packed bits as numbers (bf16 -> fp32 doubles the bytes and
  breaks the packed shape, some bit patterns are NaNs whose payload a cast may change, and uint8
  codes would become the numbers 0-255). The group is *opaque* (See [Note: opaque groups] in
  _engine/flat.py), which also admits a non-floating dtype into a flat group (uint8 codes are
  bytes; the gathers move bytes, See [Note: coalesced gathers of several dtypes] in
  _comm/collectives.py): ``full_state_dict``, the streamed saves and ``teardown`` give the codes
  back in their storage dtype, bit for bit. At stage 3 the group is sharded like every other
  (each rank rests on 1/N of the packed bytes: about 0.5/N bytes per base parameter, uint8 or
  not) and gathered per unit; gathering writes the same bytes back into the flat buffer and
  points ``param.data`` at its view, which keeps the ``Params4bit`` object, and with it the
  ``quant_state`` attribute, untouched: bnb's matmul finds both as it left them. The
  quant_state's own tensors (absmax: 4 bytes per 64 base parameters; 0.125 + a little with
  double quantization) stay whole on every rank: they are attributes, not parameters. A released
  uint8 weight reads 255 everywhere (an integer has no NaN: See nan_placeholder).
* On a CPU with AVX512-BF16, ``Linear4bit.forward`` in eval mode without gradients repacks its
  weight into another layout *in place* (``weight.data`` and ``quant_state`` replaced, once).
  A weight that is a view into a flat buffer must not be replaced (the next gather would undo it,
  or the repacked tensor would escape the shard), so ``setup`` turns that repack off on the
  ``Linear4bit`` modules whose weight a flat group holds (bnb's own switch,
  ``support_avx512bf16_for_cpu``; the unpacked kernel computes the same matmul), and
  ``teardown`` turns it back. A weight already repacked before ``setup`` is refused by name.
* 8-bit bases (``load_in_8bit``: ``Int8Params`` with its ``SCB`` statistics, which bnb rewrites
  on the first forward) are refused by name: nothing here has been checked against them.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn


def _is_bitsandbytes(obj) -> bool:
    return type(obj).__module__.split(".")[0] == "bitsandbytes"


def packed_4bit(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Parameter]]:
    """(module name, module, weight) for every module whose weight is a bitsandbytes ``Params4bit``."""
    for name, module in model.named_modules():
        p = module._parameters.get("weight")
        if p is not None and _is_bitsandbytes(p) and hasattr(p, "quant_state"):
            yield name, module, p


def refuse_unsupported(model: nn.Module) -> None:
    """Refuse, by name and with the fix, the bitsandbytes parameters ZeRO does not shard exactly."""
    for name, p in model.named_parameters():
        if _is_bitsandbytes(p) and type(p).__name__ == "Int8Params":
            raise ValueError(
                f"zero_strategy: {name} is a bitsandbytes 8-bit weight (load_in_8bit); 8-bit bases are not "
                "supported under ZeRO. Load the base in 4 bits instead: BitsAndBytesConfig(load_in_4bit=True, "
                "bnb_4bit_quant_storage=torch.bfloat16) (QLoRA), or in bf16 without quantization.")
    for name, _, p in packed_4bit(model):
        state = p.quant_state
        if state is None or not getattr(p, "bnb_quantized", True):
            raise ValueError(
                f"zero_strategy: {name}.weight is a bitsandbytes Params4bit that is not quantized yet (bnb "
                "quantizes it when it is moved to a device). Quantize before setup: load the model with "
                "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)), or "
                "call .to(device) on it first.")
        if getattr(state, "packing_format_for_cpu", False):
            raise ValueError(
                f"zero_strategy: {name}.weight was repacked by bitsandbytes for its CPU kernel (an eval-mode "
                "forward without gradients before setup). Call setup on the model as loaded (or after "
                "model.train()), before running it in eval mode.")


def kept_dtypes(model: nn.Module) -> dict[int, torch.dtype]:
    """id(weight) -> its storage dtype, for every floating packed 4-bit weight: its flat group keeps
    the packed bytes as they are. See [Note: packed 4-bit parameters under ZeRO]."""
    return {id(p): p.dtype for _, _, p in packed_4bit(model)}


def place_states(model: nn.Module, device: torch.device) -> None:
    """Move every packed 4-bit weight's quant state to the device its codes are gathered on: the
    one-call loader computes them on the CPU (See [Note: quantizing per slice] in
    transformers/_quantized.py), while bnb's matmul reads them beside the codes. A state already
    there (transformers loaded the base with ``device_map``) is left alone."""
    for _, _, p in packed_4bit(model):
        if p.quant_state.absmax.device != device:
            p.quant_state.to(device)


def keep_packed_layout(model: nn.Module, grouped: set[int]) -> list[Callable[[], None]]:
    """Turn off bnb's in-place CPU repack on the ``Linear4bit`` modules whose weight a flat group holds
    (``grouped``: ids of the grouped parameters); returns the callbacks that turn it back on.
    See [Note: packed 4-bit parameters under ZeRO]."""
    undo: list[Callable[[], None]] = []
    for _, module, p in packed_4bit(model):
        was = getattr(module, "support_avx512bf16_for_cpu", False)
        if id(p) in grouped and was:
            module.support_avx512bf16_for_cpu = False
            undo.append(lambda m=module, was=was: setattr(m, "support_avx512bf16_for_cpu", was))
    return undo
