"""A QLoRA base loaded sharded: bitsandbytes' 4-bit quantization, computed for each rank's slices.

[Note: quantizing per slice]
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` in
transformers swaps every ``nn.Linear`` it quantizes for a bitsandbytes ``Linear4bit`` and, as each
weight is read, quantizes it whole (``Params4bit(value, ...).to(device)``): packed codes, two per
byte, in the storage dtype, plus a ``quant_state`` (absmax per block of ``blocksize`` elements of the
flattened weight, the code book, with double quantization a nested state over the absmax).
Here the same modules are swapped in (transformers' own quantizer, ``preprocess_model``), and then:

* the quant state is computed here, at load, on every rank, one weight at a time (the weight read
  whole, quantized by bitsandbytes exactly as transformers does, the codes dropped): it is small
  (about 0.13 bytes per base parameter with double quantization) and every rank keeps it whole
  anyway (See [Note: packed 4-bit parameters under ZeRO] in _model/quantized.py). The weight becomes
  a ``Params4bit`` on the meta device with the packed shape and storage dtype and that quant state,
  so ``setup`` builds the opaque flat groups of the packed codes as for a base transformers loaded.
* the codes are computed at ``setup`` for this rank's slice only: a packed element range covers a
  byte range, which covers the base elements ``[2*b0, 2*b1)``; the blocks that hold them are read
  from the checkpoint (at most one block more at each end) and quantized on their own. A block's
  codes depend only on the block (its absmax is its own largest magnitude; double quantization
  compresses the absmax afterwards and never feeds back into the codes), so the slice's codes are
  the whole weight's codes bit for bit (tests/test_qlora.py compares them with transformers').

So a rank holds at most one base weight in the checkpoint's dtype while it loads, and at rest its
1/N of the packed codes plus the quant states. Refused by name: an 8-bit base, a quantization config
that is not bitsandbytes', GPT-2-style ``Conv1D`` layers (transformers transposes them before
quantizing) and a 4-bit layer whose weight the checkpoint lacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def quantizer_for(quantization_config, config, dtype: torch.dtype):
    """transformers' quantizer for a 4-bit bitsandbytes config (None for no config); refuses the rest."""
    if quantization_config is None:
        return None
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    if not isinstance(quantization_config, BitsAndBytesConfig) or not quantization_config.load_in_4bit:
        what = ("load_in_8bit" if getattr(quantization_config, "load_in_8bit", False)
                else type(quantization_config).__name__)
        raise ValueError(
            f"zero_strategy.transformers.from_pretrained quantizes only 4-bit bitsandbytes bases (QLoRA), not "
            f"{what}. Pass BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', ...), or load with "
            "transformers' from_pretrained and then zero_strategy.setup (8-bit bases are refused there too).")
    quantizer = AutoHfQuantizer.from_config(quantization_config, pre_quantized=False)
    quantizer.validate_environment(device_map={"": "cpu"}, weights_only=True, dtype=dtype)
    config.quantization_config = quantization_config
    return quantizer


def swap_in_4bit_layers(model, quantizer, dtype: torch.dtype) -> None:
    """transformers' own module swap (``nn.Linear`` -> ``Linear4bit`` where it quantizes); the model's
    parameters are on the meta device, and so are the new layers'."""
    from accelerate import init_empty_weights

    with torch.device("cpu"), init_empty_weights(include_buffers=False):
        quantizer.preprocess_model(model=model, dtype=dtype, device_map={"": "cpu"}, checkpoint_files=None)


def finish(model, quantizer) -> None:
    """What transformers does after loading: the quantizer on the model, ``is_loaded_in_4bit``, the config."""
    model.hf_quantizer = quantizer
    quantizer.postprocess_model(model)


@dataclass(frozen=True)
class _Packed:
    """One 4-bit weight as the checkpoint holds it and as bitsandbytes packs it."""
    shape: torch.Size            # packed: [codes / (2 * storage itemsize), 1]
    storage: torch.dtype         # bnb_4bit_quant_storage
    numel: int                   # base elements (the checkpoint tensor's)
    dtype: torch.dtype           # the dtype quantized from (the model's)
    blocksize: int
    quant_type: str


class QuantizedReader:
    """The loader's reader, with the packed codes of every 4-bit weight computed per slice (See
    [Note: quantizing per slice]); every other name goes to ``read`` as it is."""

    def __init__(self, read, packed: dict[str, _Packed]):
        self.read, self.packed = read, packed

    def _find(self, names: list[str]) -> tuple[str, _Packed] | None:
        return next(((n, self.packed[n]) for n in names if n in self.packed), None)

    def shape_of(self, names: list[str]):
        found = self._find(names)
        if found is None:
            return self.read.shape_of(names)
        return list(found[1].shape), found[1].storage

    def __call__(self, names: list[str], start: int, end: int):
        found = self._find(names)
        if found is None:
            return self.read(names, start, end)
        return _codes(self.read, *found, start, end)


def _bitsandbytes():
    """bitsandbytes, imported only where a 4-bit base is loaded (the ``qlora`` extra installs it)."""
    try:
        import bitsandbytes
        import bitsandbytes.functional  # noqa: F401  (the submodule _codes quantizes with)
    except ImportError as e:  # transformers refuses a BitsAndBytesConfig without it first; say the fix here too
        raise ImportError("loading a 4-bit base needs bitsandbytes: pip install 'zero-strategy[qlora]'") from e
    return bitsandbytes


def _codes(read, name: str, w: _Packed, start: int, end: int) -> torch.Tensor:
    """Packed elements [start, end) of weight ``name`` (in its storage dtype), from the blocks they cover."""
    F = _bitsandbytes().functional

    size = w.storage.itemsize
    b0, b1 = start * size, end * size                      # bytes
    e0, e1 = min(2 * b0, w.numel), min(2 * b1, w.numel)   # base elements (two codes per byte)
    out = torch.zeros(b1 - b0, dtype=torch.uint8)
    if e1 > e0:
        a0, a1 = e0 // w.blocksize * w.blocksize, min(-(-e1 // w.blocksize) * w.blocksize, w.numel)
        values = read([name], a0, a1).to(w.dtype)      # [a1 - a0]: whole blocks
        codes, _ = F.quantize_4bit(values, blocksize=w.blocksize, compress_statistics=False,
                                   quant_type=w.quant_type, quant_storage=torch.uint8)
        codes = codes.reshape(-1)[(e0 - a0) // 2:]
        n = min(codes.numel(), b1 - b0)
        out[:n] = codes[:n]
    return out.view(w.storage)


@torch.no_grad()
def quantize_states(model, read) -> QuantizedReader:
    """Every ``Linear4bit`` weight of the (meta) model becomes a quantized meta ``Params4bit`` with its
    quant state, computed from the checkpoint one weight at a time; returns the reader that gives
    each rank its codes at ``setup``. See [Note: quantizing per slice]."""
    bnb = _bitsandbytes()
    packed: dict[str, _Packed] = {}
    for name, module in model.named_modules():
        w = module._parameters.get("weight")
        if not isinstance(w, bnb.nn.Params4bit):
            continue
        key = f"{name}.weight" if name else "weight"
        source = getattr(module, "source_cls", None)
        if source is not None and source.__name__ == "Conv1D":
            raise ValueError(f"zero_strategy.transformers.from_pretrained: {key} is a GPT-2-style Conv1D layer, "
                             "which transformers transposes before quantizing; this loader does not quantize those "
                             "in slices. Load with transformers' from_pretrained(..., quantization_config=...) and "
                             "then zero_strategy.setup.")
        found = read.shape_of([key])
        if found is None:
            raise ValueError(f"zero_strategy.transformers.from_pretrained: the checkpoint has no {key}, a layer "
                             "quantized to 4 bits; nothing here initializes and quantizes a missing weight. Load "
                             "with transformers' from_pretrained(..., quantization_config=...) and then setup.")
        if tuple(found[0]) != tuple(w.shape):
            raise ValueError(f"size mismatch for {key}: copying a param with shape {torch.Size(found[0])} from "
                             f"checkpoint, the shape in current model is {w.shape}.")
        numel = w.numel()
        whole = read([key], 0, numel).reshape(w.shape).to(w.dtype)
        quantized = bnb.nn.Params4bit(whole, requires_grad=False, **w.__dict__).to("cpu")  # as transformers does
        state = quantized.quant_state
        meta = torch.empty(quantized.shape, dtype=quantized.dtype, device="meta")
        module._parameters["weight"] = bnb.nn.Params4bit(
            meta, requires_grad=False, quant_state=state, blocksize=quantized.blocksize,
            compress_statistics=quantized.compress_statistics, quant_type=quantized.quant_type,
            quant_storage=quantized.quant_storage, module=module, bnb_quantized=True)
        module._is_hf_initialized = True
        packed[key] = _Packed(quantized.shape, quantized.dtype, numel, w.dtype, quantized.blocksize,
                              quantized.quant_type)
        del whole, quantized
    return QuantizedReader(read, packed)
