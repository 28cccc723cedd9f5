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
conversion mapping and the base-model prefix, added or stripped), new modules (a
classification head) initialized by the model's ``_init_weights`` and named in a
warning, unused checkpoint keys named too, the generation config, eval mode.

Not handled, and refused by name rather than loaded wrong: checkpoints that only
``pytorch_model.bin`` holds (safetensors only), and parameters that transformers builds
by merging several checkpoint tensors (its ``WeightConverter``s, e.g. per-expert MoE
weights fused into one tensor): those go through ``from_pretrained`` + ``setup``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from .._logging import RankZeroFilter
from ..checkpoint._layout import CheckpointError
from ..api import DeferredWeights, defer_weights
from ..checkpoint._sharded_weights import load_sharded_weights, safetensors_reader, safetensors_weight_map

__all__ = ["from_pretrained"]

log = logging.getLogger(__name__)
log.addFilter(RankZeroFilter())


def from_pretrained(model_class, name_or_path: str | Path, *, dtype=None, torch_dtype=None,
                    revision: str | None = None, trust_remote_code: bool = False,
                    attn_implementation: str | None = None, ignore_mismatched_sizes: bool = False,
                    **config_overrides):
    """An empty ``model_class`` (an Auto class or a model class) whose weights ``setup`` reads sharded.

    ``name_or_path``: a local model directory, or a hub name already in the local cache
    (or reachable). ``dtype`` (``torch_dtype`` is accepted too): the parameters' dtype,
    ``"auto"`` by default as in ``from_pretrained``. Other keywords override config
    attributes (``num_labels=3``), as they do there. A checkpoint tensor whose shape differs
    from the model's (a head saved for another number of labels) is refused here, naming
    each one and both shapes; ``ignore_mismatched_sizes=True`` leaves those parameters
    newly initialized instead and names them in a warning, as ``from_pretrained`` does.
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
    dtype = _resolve_dtype(dtype if dtype is not None else torch_dtype, config, directory, weight_map)
    model = _build_empty(model_class, config, dtype, trust_remote_code, attn_implementation)
    to_checkpoint, unused = _key_map(model, weight_map)
    read = safetensors_reader(directory)
    mismatched = _mismatched_sizes(model, to_checkpoint, read, ignore_mismatched_sizes)
    for key in mismatched:
        del to_checkpoint[key]  # left as the model's initialization made them
    _load_buffers(model, directory, weight_map, to_checkpoint)
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

    defer_weights(model, DeferredWeights(read=_Renamed(read, to_checkpoint), init=_init_module,
                                         loaded=loaded, fill=_fill))
    _load_generation_config(model, directory)
    model.eval()  # as from_pretrained returns it
    return model


class _Renamed:
    """The checkpoint's reader, asked by model names (through transformers' renamings)."""

    def __init__(self, read, to_checkpoint: dict[str, str]):
        self.read, self.to_checkpoint = read, to_checkpoint

    def _keys(self, names: list[str]) -> list[str]:
        return [self.to_checkpoint[n] for n in names if n in self.to_checkpoint]

    def shape_of(self, names: list[str]):
        return self.read.shape_of(self._keys(names))

    def __call__(self, names: list[str], start: int, end: int):
        return self.read(self._keys(names), start, end)


def _mismatched_sizes(model, to_checkpoint: dict[str, str], read, ignore: bool) -> dict[str, tuple]:
    """model key -> (checkpoint shape, model shape) of every tensor whose shapes differ, from the
    headers alone; refused (every rank, before setup) unless ``ignore``. See [Note: shapes before
    values] in checkpoint/_sharded_weights.py."""
    mismatched = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        found = read.shape_of([to_checkpoint[key]]) if key in to_checkpoint else None
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
    return load_sharded_weights(model, read, strict=False)  # what the checkpoint lacks keeps its init


def _init_module(model, module) -> None:
    """The model's own initialization, module by module (what the checkpoint lacks keeps it)."""
    model._init_weights(module)


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


def _key_map(model, weight_map: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """model key -> checkpoint key through transformers' renamings, and the checkpoint keys unused.

    A parameter that only a merging converter would produce is refused by name."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict(keep_vars=True)
    transient = {name for name, _ in model.named_buffers()} - set(meta_state)  # non-persistent: computed, not read
    base = getattr(model, "base_model_prefix", "") or ""
    transient |= {name[len(base) + 1:] for name in transient if base and name.startswith(base + ".")}
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    to_checkpoint: dict[str, str] = {}
    converted: dict[str, list[str]] = {}
    unused: list[str] = []
    for key in weight_map:
        target, converter = rename_source_key(key, renamings, converters, getattr(model, "base_model_prefix", None),
                                              meta_state)
        if target not in meta_state:
            if target not in transient and not any(p.search(key) for p in ignored):
                unused.append(key)
        elif converter is not None:
            converted.setdefault(target, []).append(key)
        else:
            to_checkpoint.setdefault(target, key)
    if converted:
        target, keys = next(iter(converted.items()))
        raise CheckpointError(
            f"{type(model).__name__}: {len(converted)} parameter(s) are built by transformers from several "
            f"checkpoint tensors (e.g. {target} from {keys[:3]}{' ...' if len(keys) > 3 else ''}), which this "
            "loader does not read in slices; use transformers' from_pretrained and then zero_strategy.setup")
    return to_checkpoint, sorted(unused)


def _load_buffers(model, directory: Path, weight_map: dict[str, str], to_checkpoint: dict[str, str]) -> None:
    """Persistent buffers the checkpoint holds, whole (they are small, and every rank keeps them)."""
    from safetensors import safe_open

    with torch.no_grad():
        for name, buf in model.named_buffers():
            key = to_checkpoint.get(name)
            if key is not None:
                with safe_open(directory / weight_map[key], framework="pt") as f:
                    buf.copy_(f.get_tensor(key))


def _load_generation_config(model, directory: Path) -> None:
    if (directory / "generation_config.json").exists() and getattr(model, "can_generate", lambda: False)():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(directory)
