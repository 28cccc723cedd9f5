"""One call to load a Hugging Face model sharded: no rank ever holds it whole.

::

    from zero_strategy.transformers import from_pretrained

    model = from_pretrained(AutoModelForCausalLM, "path/or/hub-name", dtype=torch.bfloat16)
    model, optimizer = zero_strategy.setup(model, torch.optim.AdamW(model.parameters()), "zero3")
    # or: ZeroTrainer(model=model, ...), accelerator.prepare(model, optimizer), Lightning, Fabric

``transformers``' own ``from_pretrained`` reads every tensor on every rank, and the
documented way around it took three calls and a ``param_init_fn`` the user had to know
about (a meta build, ``setup(..., param_init_fn=model._init_weights)``,
``load_sharded_weights``). Here the model is built with its parameters on the meta device
(buffers real: rotary frequencies and the like are computed by their constructors as
usual), and its checkpoint is recorded for ``setup`` to read, each rank only the slices
of its own shards (See [Note: weights that arrive at setup]). Everything else follows
``from_pretrained``: the config with its keyword overrides, ``dtype`` ("auto" by
default: the config's, else the checkpoint's), transformers' own key renamings (its
conversion mapping and the base-model prefix, added or stripped), the parameters its
weight converters build from several checkpoint tensors (a mixture-of-experts layer's
``experts.gate_up_proj`` from every expert's ``w1`` and ``w3``: run on where the values come
from, so a rank reads only the experts and rows its shards hold, See [Note: conversions run
on row ids] in checkpoint/_converted.py), the modules the model keeps in fp32
(``_keep_in_fp32_modules_strict``, as the model's constructor makes them), new modules (a
classification head) initialized by the model's ``_init_weights`` and named in a warning,
unused checkpoint keys named too, the generation config, eval mode; and ``save_pretrained``
writes the checkpoint's own format back (per-expert tensors), streamed unit by unit.

A ``quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)`` loads a QLoRA base the
same way: bitsandbytes' 4-bit codes computed for each rank's slices only (See [Note: quantizing
per slice] in transformers/_quantized.py).

Not handled, and refused by name rather than loaded wrong: checkpoints that only
``pytorch_model.bin`` holds (safetensors only), checkpoints quantized on disk (gpt-oss's
MXFP4, a saved 4-bit base: a ``quantization_config`` in the checkpoint's config), 8-bit and
non-bitsandbytes quantization configs, and a converter that computes values rather than
rearranging them: those go through ``from_pretrained`` + ``setup``.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import weakref
from pathlib import Path

import torch

from . import _quantized
from .._logging import RankZeroFilter
from ..checkpoint._layout import CheckpointError
from ..api import DeferredWeights, defer_weights
from ..checkpoint._converted import ConvertedGroup
from ..checkpoint._sharded_weights import (dtype_of_safetensors, load_sharded_weights, safetensors_reader,
                                           safetensors_weight_map)

__all__ = ["from_pretrained"]

log = logging.getLogger(__name__)
log.addFilter(RankZeroFilter())


def from_pretrained(model_class, name_or_path: str | Path, *, dtype=None, torch_dtype=None,
                    revision: str | None = None, trust_remote_code: bool = False,
                    attn_implementation: str | None = None, ignore_mismatched_sizes: bool = False,
                    quantization_config=None, **config_overrides):
    """An empty ``model_class`` (an Auto class or a model class) whose weights ``setup`` reads sharded.

    ``name_or_path``: a local model directory, or a hub name already in the local cache
    (or reachable). ``dtype`` (``torch_dtype`` is accepted too): the parameters' dtype,
    ``"auto"`` by default as in ``from_pretrained``. Other keywords override config
    attributes (``num_labels=3``), as they do there. A checkpoint tensor whose shape differs
    from the model's (a head saved for another number of labels) is refused here, naming
    each one and both shapes; ``ignore_mismatched_sizes=True`` leaves those parameters
    newly initialized instead and names them in a warning, as ``from_pretrained`` does.
    ``quantization_config``: a ``BitsAndBytesConfig(load_in_4bit=True, ...)`` loads a QLoRA base, each
    rank quantizing only its slices at ``setup`` (See [Note: quantizing per slice] in
    transformers/_quantized.py); other quantization configs are refused by name.
    """
    from transformers import AutoConfig

    directory = _model_directory(name_or_path, revision)
    weight_map = safetensors_weight_map(directory)
    config, unknown = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code,
                                                 return_unused_kwargs=True, **config_overrides)
    if unknown:
        raise TypeError(f"zero_strategy.transformers.from_pretrained: {sorted(unknown)} are neither arguments nor "
                        f"attributes of {type(config).__name__}")
    config._name_or_path = str(name_or_path)
    _refuse_quantized(config)
    dtype = _resolve_dtype(dtype if dtype is not None else torch_dtype, config, directory, weight_map)
    quantizer = _quantized.quantizer_for(quantization_config, config, dtype)
    model = _build_empty(model_class, config, dtype, trust_remote_code, attn_implementation)
    if quantizer is not None:
        _quantized.swap_in_4bit_layers(model, quantizer, dtype)
    read = safetensors_reader(directory)
    to_checkpoint, converted, unused = _key_map(model, weight_map, read)
    renamed = _Renamed(read, to_checkpoint, converted)
    if quantizer is not None:  # See [Note: quantizing per slice] in transformers/_quantized.py
        renamed = _quantized.quantize_states(model, renamed)
        _quantized.finish(model, quantizer)
    mismatched = _mismatched_sizes(model, renamed, ignore_mismatched_sizes)
    for key in mismatched:  # left as the model's initialization made them
        to_checkpoint.pop(key, None)
        converted.pop(key, None)
    _load_buffers(model, renamed)
    model_name = type(model).__name__  # (the record must not refer to the model: See DeferredWeights)

    def loaded(missing: list[str]) -> None:
        missing = [m for m in missing if m not in mismatched]
        if missing:
            log.warning("Some weights of %s were not initialized from the model checkpoint at %s and are "
                        "newly initialized: %s", model_name, name_or_path, missing)
        if mismatched:
            log.warning("Some weights of %s were not initialized from the model checkpoint at %s and are newly "
                        "initialized because the shapes did not match:\n%s\nYou should probably TRAIN this model "
                        "on a down-stream task to be able to use it for predictions and inference.", model_name,
                        name_or_path, "\n".join(f"- {k}: found shape {a} in the checkpoint and {b} in the model "
                                                 "instantiated" for k, (a, b) in mismatched.items()))
        if unused:
            log.warning("Some weights of the model checkpoint at %s were not used when initializing %s: %s",
                        name_or_path, model_name, unused)

    defer_weights(model, DeferredWeights(read=_AdapterNames(renamed), init=_init_module,
                                         loaded=loaded, fill=_fill))
    _load_generation_config(model, directory)
    model.eval()  # as from_pretrained returns it
    return model


class _Renamed:
    """The checkpoint's reader, asked by model names: through transformers' renamings, and for the
    parameters its converters build, through their conversion (See [Note: conversions run on row
    ids] in checkpoint/_converted.py)."""

    def __init__(self, read, to_checkpoint: dict[str, str], converted: dict[str, ConvertedGroup]):
        self.read, self.to_checkpoint, self.converted = read, to_checkpoint, converted

    def _keys(self, names: list[str]) -> list[str]:
        return [self.to_checkpoint[n] for n in names if n in self.to_checkpoint]

    def _group(self, names: list[str]) -> tuple[str, ConvertedGroup] | None:
        return next(((n, self.converted[n]) for n in names if n in self.converted), None)

    def shape_of(self, names: list[str]):
        found = self._group(names)
        if found is not None and not self._keys(names):
            name, group = found
            return list(group.targets[name]), group.dtype
        return self.read.shape_of(self._keys(names))

    def __call__(self, names: list[str], start: int, end: int):
        found = self._group(names)
        if found is not None and not self._keys(names):
            return found[1].read(found[0], start, end)
        return self.read(self._keys(names), start, end)


class _AdapterNames:
    """The reader asked by the names a set-up model has, which may be PEFT's: ``get_peft_model``
    between this loader and ``setup`` moves each wrapped layer's weight to ``<layer>.base_layer.weight``
    (the adapters themselves are not in the checkpoint, and the model's initialization makes them)."""

    def __init__(self, read):
        self.read = read

    @staticmethod
    def _names(names: list[str]) -> list[str]:
        return [*names, *(n.replace(".base_layer.", ".") for n in names if ".base_layer." in n)]

    def shape_of(self, names: list[str]):
        return self.read.shape_of(self._names(names))

    def __call__(self, names: list[str], start: int, end: int):
        return self.read(self._names(names), start, end)


def _mismatched_sizes(model, read: "_Renamed", ignore: bool) -> dict[str, tuple]:
    """model key -> (checkpoint shape, model shape) of every tensor whose shapes differ, from the
    headers alone; refused (every rank, before setup) unless ``ignore``. See [Note: shapes before
    values] in checkpoint/_sharded_weights.py."""
    mismatched = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        found = read.shape_of([key])
        if found is not None and tuple(found[0]) != tuple(tensor.shape):
            mismatched[key] = (torch.Size(found[0]), tensor.shape)
    if mismatched and not ignore:
        lines = [f"size mismatch for {k}: copying a param with shape {a} from checkpoint, the shape in current "
                 f"model is {b}." for k, (a, b) in mismatched.items()]
        raise CheckpointError(
            f"Error(s) in loading state_dict for {type(model).__name__}:\n\t" + "\n\t".join(lines)
            + "\n\tYou may consider adding `ignore_mismatched_sizes=True` to `from_pretrained(...)` if appropriate.")
    return mismatched


def _fill(model, read) -> list[str]:
    """This rank's slices of the parameters; then the persistent buffers again, whole: the model's
    ``_init_weights``, run on every module at setup, resets some that the checkpoint holds
    (DeepSeek-V3's ``e_score_correction_bias`` to zeros), which ``from_pretrained`` loads after it."""
    missing = load_sharded_weights(model, read, strict=False)  # what the checkpoint lacks keeps its init
    _load_buffers(model, read)
    return missing


def _init_module(model, module) -> None:
    """The model's own initialization, module by module (what the checkpoint lacks keeps it); a PEFT
    LoRA matrix by PEFT's own (See :func:`_init_lora`)."""
    if not _init_lora(model, module):
        model._init_weights(module)


def _init_lora(model, module) -> bool:
    """PEFT's initialization of a LoRA matrix, where ``get_peft_model`` ran between this loader and
    ``setup``: the model is on the meta device then, so PEFT built its adapters there and initialized
    nothing, and the model's ``_init_weights`` would draw ``lora_B`` at random where PEFT makes it zero
    (the adapted model starting equal to the base). Returns whether ``module`` was a LoRA matrix.
    Initializations that read the base weights (PiSSA, OLoRA, LoftQ, DoRA's magnitude, ...) are refused."""
    if not isinstance(module, torch.nn.Linear):  # LoRA's matrices are Linear layers
        return False
    found = None
    for layer in model.modules():
        if hasattr(layer, "reset_lora_parameters") and hasattr(layer, "lora_A"):
            found = next(((layer, name) for name in layer.lora_A
                          if module is layer.lora_A[name] or module is layer.lora_B[name]), None)
            if found is not None:
                break
    if found is None:
        return False
    layer, adapter = found
    config = getattr(model, "peft_config", {}).get(adapter)
    init = getattr(config, "init_lora_weights", True)
    if getattr(config, "use_dora", False) or init not in (True, False, "gaussian"):
        what = "use_dora=True" if getattr(config, "use_dora", False) else f"init_lora_weights={init!r}"
        raise ValueError(f"zero_strategy: LoRA adapter {adapter!r} on a model from zero_strategy.transformers."
                         f"from_pretrained uses {what}, which PEFT computes from the base weights, and those are "
                         "not loaded until setup. Use init_lora_weights=True or 'gaussian', or load the model with "
                         "transformers' from_pretrained before get_peft_model and setup.")
    if init is False:  # PEFT leaves both as nn.Linear makes them
        module.reset_parameters()
    elif module is layer.lora_A[adapter] and init is True:  # as PEFT's reset_lora_parameters; each matrix once
        torch.nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
    elif module is layer.lora_A[adapter]:
        torch.nn.init.normal_(module.weight, std=1 / layer.r[adapter])
    else:
        torch.nn.init.zeros_(module.weight)
    if getattr(module, "bias", None) is not None and init is not False:
        torch.nn.init.zeros_(module.bias)
    return True


def _model_directory(name_or_path, revision) -> Path:
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name_or_path), revision=revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as e:
        raise CheckpointError(f"zero_strategy.transformers.from_pretrained: {name_or_path!r} is not a local "
                              f"directory and the hub could not provide it ({type(e).__name__}: {e})") from None


def _resolve_dtype(dtype, config, directory: Path, weight_map: dict[str, str]) -> torch.dtype:
    if dtype is None or dtype == "auto":
        if getattr(config, "dtype", None) is not None:
            dtype = config.dtype
        else:
            from safetensors import safe_open

            first = sorted(set(weight_map.values()))[0]
            with safe_open(directory / first, framework="pt") as f:
                floats = [f.get_slice(k).get_dtype() for k in f.keys()]
            names = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
            found = next((names[d] for d in floats if d in names), "float32")
            dtype = found
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype={dtype!r}: give a torch.dtype, its name, or 'auto'")
        dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={dtype!r}: zero_strategy.transformers.from_pretrained takes one dtype for the "
                         "whole model (a torch.dtype, its name, or 'auto'), not a per-module dict")
    return dtype


def _build_empty(model_class, config, dtype: torch.dtype, trust_remote_code: bool, attn_implementation):
    from accelerate import init_empty_weights

    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    # parameters on meta, buffers real (on the CPU, whatever device context the caller is in)
    with torch.device("cpu"), init_empty_weights(include_buffers=False):
        if hasattr(model_class, "_from_config"):
            model = model_class._from_config(config, **kwargs)
        else:  # an Auto class
            model = model_class.from_config(config, trust_remote_code=trust_remote_code, **kwargs)
    # as from_pretrained does after loading: one Parameter for tied names. Outside the empty-weights
    # context, whose register_parameter would re-wrap the shared Parameter as a new one
    model.tie_weights()
    return model


def _key_map(model, weight_map: dict[str, str], read) -> tuple[dict[str, str], dict[str, ConvertedGroup], list[str]]:
    """model key -> checkpoint key through transformers' renamings; model key -> the group its
    converter builds it in (See [Note: conversions run on row ids] in checkpoint/_converted.py);
    the checkpoint keys unused. Keys are matched as transformers' ``convert_and_load_state_dict_in_model``
    matches them: in the checkpoint's natural order, every renaming, then at most one converter,
    then the base-model prefix added or stripped."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta_state = model.state_dict(keep_vars=True)
    transient = {name for name, _ in model.named_buffers()} - set(meta_state)  # non-persistent: computed, not read
    base = getattr(model, "base_model_prefix", "") or ""
    transient |= {name[len(base) + 1:] for name in transient if base and name.startswith(base + ".")}
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    to_checkpoint: dict[str, str] = {}
    sources: dict[str, tuple[object, dict[str, list[str]]]] = {}  # first target -> (converter, its keys)
    unused: list[str] = []
    for key in sorted(weight_map, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, base or None, meta_state)
        if target not in meta_state and key in meta_state:  # as transformers: only the prefix, if anything
            target, pattern = rename_source_key(key, [], [], base or None, meta_state)
        if target not in meta_state:
            if target not in transient and not any(p.search(key) for p in ignored):
                unused.append(key)
        elif pattern is not None:
            converter, keys = sources.setdefault(target, (copy.deepcopy(by_pattern[pattern]), {}))
            keys.setdefault(pattern, []).append(key)
        else:
            to_checkpoint.setdefault(target, key)
    converted: dict[str, ConvertedGroup] = {}
    for first, (converter, keys) in sources.items():
        ops = [type(op).__name__ for op in getattr(converter, "operations", [])]
        what = (f"{type(model).__name__}: {first} (transformers' {type(converter).__name__} of {ops} over "
                f"{converter.source_patterns})")
        group = ConvertedGroup(what, keys, _conversion(model, first, converter), read.slice_of, dtype_of_safetensors)
        converted.update({name: group for name in group.targets if name in meta_state})
    model._weight_conversions = [t for t in transforms if t.was_used()]  # what save_pretrained reverts, as
    # after transformers' own from_pretrained
    return to_checkpoint, converted, sorted(unused)


def _conversion(model, first: str, converter):
    """The converter's own ``convert`` as a function of its source tensors. It holds the model
    weakly: the loader's record must not keep the model alive (See DeferredWeights)."""
    model_ref = weakref.proxy(model)

    def convert(inputs: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        fresh = copy.deepcopy(converter)
        for pattern, tensors in inputs.items():
            fresh.collected_tensors[pattern] = list(tensors)
        out = fresh.convert(first, model=model_ref, config=model_ref.config)
        return {name: t[0] if isinstance(t, list) else t for name, t in out.items()}
    return convert


def _refuse_quantized(config) -> None:
    """A checkpoint whose weights are quantized on disk (gpt-oss's MXFP4 experts, FP8, GPTQ, ...)
    holds packed blocks and scales where the model has floating-point parameters; dequantizing
    computes values, which the per-slice conversions do not (See [Note: conversions run on row
    ids] in checkpoint/_converted.py)."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    method = getattr(method, "value", method)
    if method == "bitsandbytes":  # a 4-bit (or 8-bit) base saved by transformers: setup shards it as loaded
        raise CheckpointError(
            f"zero_strategy.transformers.from_pretrained: {config._name_or_path} holds bitsandbytes-quantized "
            "weights, which this loader does not read in slices: load it with transformers' "
            "AutoModelForCausalLM.from_pretrained(path) (the quantization is read from its config), then "
            "zero_strategy.setup(model, optimizer, 'zero3'), which shards the 4-bit weights; or load the "
            "unquantized checkpoint here with quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...), "
            "which quantizes each rank's slices (docs/guides/peft-and-generation.md, QLoRA)")
    raise CheckpointError(
        f"zero_strategy.transformers.from_pretrained: {type(config).__name__} ({config.model_type}) comes with "
        f"weights quantized on disk (quantization_config: {method}), which cannot be read in slices: load it "
        "with transformers' from_pretrained (for gpt-oss's mxfp4: quantization_config=Mxfp4Config(dequantize=True)) "
        "and then zero_strategy.setup, or save that dequantized model once with save_pretrained and load "
        "that directory here")


def _load_buffers(model, read) -> None:
    """Persistent buffers the checkpoint holds, whole (they are small, and every rank keeps them)."""
    persistent = set(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            values = read([name], 0, buf.numel()) if name in persistent else None
            if values is not None:
                buf.copy_(values.reshape(buf.shape))


def _load_generation_config(model, directory: Path) -> None:
    if (directory / "generation_config.json").exists() and getattr(model, "can_generate", lambda: False)():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
