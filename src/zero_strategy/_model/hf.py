"""The one module below the front ends that names Hugging Face transformers and PEFT.

What ``setup`` puts on their models, and why: each adjustment wraps the library's own
method with an instance attribute (the class is untouched, other models are unaffected);
_model/install.py applies them and ``teardown`` removes them. The engine never imports
these libraries: a model of theirs exists only if the user imported them, so they are
looked up in ``sys.modules`` (tests/test_layering.py holds this module to being the only one).

[Note: generate() under stage 3]
``generate()`` runs one forward per new token until every sequence of *this rank* is
done, so ranks whose prompts end (EOS, a shorter ``max_new_tokens``) at different
steps run different numbers of forwards. At stage 3 each forward all-gathers, so the
rank that finishes first leaves the others blocked in a gather until the process
group's timeout. transformers has the cure, ``synced_gpus=True`` (a finished rank
keeps running dummy forwards until all are done; each step costs one scalar
all-reduce), and turns it on by itself only for DeepSpeed ZeRO-3 and FSDP. We make it
the default of every ``GenerationMixin`` module in a set-up model whose parameters
are sharded over more than one rank; an explicit ``synced_gpus=False`` is kept (and
a mismatch then ends in :class:`~zero_strategy.CollectiveTimeout`, not a hang). The
same wrapper runs ``generate()`` inside ``gathered_for_generation`` when
``gather_once_in_generate(model)`` asked for it (the TRL front end does). Inside that
block (also one the user opened) every unit stays gathered and a forward issues no
collective, so ranks may stop at different steps: ``synced_gpus`` is left off there,
which saves one all-reduce and one wait for the slowest rank per token. With expert parallelism
every forward is an all-to-all at every stage, so ``synced_gpus`` is on for every ``generate()``
(See [Note: expert parallelism] in _model/expert_parallel.py).

[Note: PEFT merges under stage 3]
``merge_and_unload()``, ``merge_adapter()`` and ``unmerge_adapter()`` rewrite base
weights in place from the adapter weights. At rest a stage-3 parameter is a
placeholder that refuses writes, so they are run with the units they touch gathered
and every rank writes its own slice back (the merge is deterministic, so every rank
computed the same values: nothing is broadcast). ``safe_merge=True`` replaces
``weight.data`` instead of writing into it; that is taken back into the flat buffer.
The merged model stays set up: save it with ``save_pretrained`` on every rank (at stage 3
it streams unit by unit: See [Note: streamed save_pretrained]).

[Note: resize_token_embeddings after setup]
Resizing replaces the embedding's data by a tensor of another shape, while its flat
buffer, shards, fp32 master and optimizer state were sized at setup (and at stage 3
the old rows are not even on this rank). Rather than let the next gather undo the
resize, or train a tensor the optimizer does not hold, a set-up model refuses it with
the fix: resize before ``setup`` / ``accelerator.prepare`` / ``Trainer(...)``, as
DeepSpeed-ZeRO-3 and FSDP users do.

[Note: streamed save_pretrained]
transformers' ``save_pretrained`` starts from ``self.state_dict()``: at stage 3 that is
every unit gathered in turn and copied, so the writing rank holds the whole model at
once (and so did every other rank, which writes nothing). Here the weights of one unit
are gathered (group by group, from the fp32 masters where a group trains, as
``full_state_dict`` does), copied to the host, appended to the safetensors file being
written and dropped before the next unit is gathered. The device holds one group
beyond its shards, the writing rank one unit's host copies, the other ranks nothing.

What is written is what the library would write: the names come from
``state_dict(keep_vars=True)`` (no gather), less ``_keys_to_ignore_on_save`` and the
tied duplicates the library's own ``remove_tied_weights_from_state_dict`` drops (it
keys meta tensors by the parameter object, which is how the shapes are described to
it here); each tensor in the dtype the model's parameter has (the compute dtype, as
``state_dict()`` would give), or ``dtype=...`` (an extra keyword: ``torch.float32``
writes the fp32 masters). Files are split at ``max_shard_size`` with the library's rule
(a tensor bigger than the limit alone in its file) into ``model-0000i-of-0000N.safetensors``
and a ``model.safetensors.index.json``, which ``from_pretrained`` reads. The
configuration files and the clean-up of an older save are left to the library itself:
it is called with an empty ``state_dict`` first, and the empty weights file it writes
is then replaced. The library's path is taken unchanged (whole model, as before) where
streaming would change the result: an explicit ``state_dict``, ``push_to_hub``,
``distributed_checkpoint``, ``safe_serialization=False``, a quantized or
adapter-carrying model. A model whose saved names and layout the library converts
(``revert_weight_conversion``: a mixture-of-experts layer's fused experts written back one
tensor per expert, renamed keys) is streamed too, each unit's tensors converted as they
arrive (See [Note: converted saves] in _model/saves.py), unless the conversion joins
tensors of several units, which takes the library's path.

[Note: streamed adapter saves]
``PeftModel.save_pretrained`` filters ``self.state_dict()`` down to the adapter, so at
stage 3 it gathered and copied the whole base model to keep a few MB. It takes a
``state_dict`` keyword, so it is given one made of the tensors it can keep: the
parameters under a module named after one of its adapters (``lora_A.default``,
``modules_to_save.default``, ``prompt_encoder.default``), every trainable parameter,
the embedding layers when ``save_embedding_layers`` is not False, and the buffers;
only the units holding those are gathered, one at a time.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import weakref
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from .._engine.engine import refuse_while_offloaded
from .gather import full_state_dict, modified_on_every_rank, unit_values, whole_model_pass
from .generation import around_generate
from .saves import BatchConversion, arrival_specs, out_dtype, write_entries
from .tiled_loss import causal_lm_forward, refuse_untileable
from .sequence_parallel import check_heads, ulysses_attention

if TYPE_CHECKING:
    from .._engine.engine import ZeroEngine

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


_PEFT_MERGES = ("merge_and_unload", "merge_adapter", "unmerge_adapter")


def library_shadows(model: nn.Module, engine: "ZeroEngine") -> list[tuple[nn.Module, str, Callable]]:
    """What to shadow on the transformers / PEFT modules inside ``model``: (module, method name,
    ``make(original) -> wrapper``), in the order _model/install.py applies them."""
    transformers = sys.modules.get("transformers")
    peft_tuners = sys.modules.get("peft.tuners.tuners_utils")
    if transformers is None and peft_tuners is None:
        return []
    peft_model = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    generation_mixin = getattr(transformers, "GenerationMixin", None) if transformers else None
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers else None
    base_tuner = getattr(peft_tuners, "BaseTuner", None) if peft_tuners else None
    shadows: list[tuple[nn.Module, str, Callable]] = []
    # once, not per module: a scan of the units per module made setup quadratic in the modules
    # of a model with many (a mixture of 2,500 experts: 8.6M Python calls instead of 2.3M)
    streams_saves = engine.plan.shards_parameters and any(u.sharded_groups for u in engine.units)
    for module in model.modules():
        wraps_generate = (engine.plan.shards_parameters or engine.expert_parallel is not None
                          or engine.config.offload_states_during_generation)
        if wraps_generate and generation_mixin is not None and isinstance(module, generation_mixin):
            shadows.append((module, "generate", functools.partial(_engine_generate, engine)))
        if pretrained is not None and isinstance(module, pretrained):
            shadows.append((module, "resize_token_embeddings", _refuse_resize))
        if streams_saves:  # See [Note: streamed save_pretrained]
            shadows.extend(_save_shadows(module, engine, pretrained, peft_model))
        if base_tuner is not None and isinstance(module, base_tuner):
            for name in _PEFT_MERGES:
                if hasattr(module, name):
                    shadows.append((module, name, functools.partial(_merge_gathered, engine)))
    return shadows




def tiled_loss_targets(model: nn.Module, tiled: bool | int) -> list[nn.Module]:
    """The transformers ``*ForCausalLM`` modules in ``model`` whose loss ``ZeroConfig(tiled_loss=tiled)``
    replaces; a model it cannot serve is refused (``setup`` asks before it shards anything)."""
    if tiled is False:
        return []
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers else None
    causal_lms = [m for m in model.modules() if pretrained is not None and isinstance(m, pretrained)
                  and type(m).__name__.endswith("ForCausalLM")]
    if not causal_lms:
        raise ValueError(
            f"zero_strategy: tiled_loss is set but {type(model).__name__} holds no transformers *ForCausalLM "
            "model, whose loss it replaces. For a model of your own, drop tiled_loss and compute the loss with "
            "zero_strategy.tiled_causal_lm_loss(model.lm_head, hidden_states, labels).")
    for module in causal_lms:
        refuse_untileable(module)
    return causal_lms


def tiled_loss_shadows(model: nn.Module, engine: "ZeroEngine") -> list[tuple[nn.Module, str, Callable]]:
    """The ``forward`` shadows that give each causal LM :func:`tiled_loss_targets` finds the tiled loss.
    See [Note: the tiled loss in a Hugging Face model] in _model/tiled_loss.py."""
    tiled = engine.config.tiled_loss
    chunk = None if tiled is True else tiled
    return [(module, "forward", causal_lm_forward(module, chunk)) for module in tiled_loss_targets(model, tiled)]


def kept_dtypes(model: nn.Module, compute_dtype: torch.dtype) -> dict[int, torch.dtype]:
    """id(param) -> fp32 for the floating parameters a transformers model keeps in fp32 when it computes
    in ``compute_dtype`` (its ``_keep_in_fp32_modules_strict``, and ``_keep_in_fp32_modules`` under fp16:
    the plan its own ``from_pretrained`` follows), matched as its loader matches them. See
    [Note: parameters kept in fp32] in _engine/units.py."""
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers else None
    if pretrained is None or compute_dtype == torch.float32:
        return {}
    kept: dict[int, torch.dtype] = {}
    for _, module in model.named_modules():
        plan_of = getattr(module, "_get_dtype_plan", None) if isinstance(module, pretrained) else None
        plan = plan_of(compute_dtype) if callable(plan_of) else {}  # (a transformers without it: none)
        patterns = [(re.compile(key.replace("*", ".*")), dtype) for key, dtype in plan.items()]  # its globs
        for name, p in module.named_parameters() if patterns else ():
            dtype = next((d for pattern, d in patterns if pattern.search(name)), None)
            if dtype is not None and p.is_floating_point():
                kept.setdefault(id(p), dtype)
    return kept


#: what sequence parallelism cannot split (See [Note: sequence parallelism] in _model/sequence_parallel.py)
_SP_REFUSED_ATTENTION = ("flex_attention", "paged")


def sequence_parallel_attention(model: nn.Module, sp) -> Callable[[], None]:
    """Run the attention of the transformers models in ``model`` under Ulysses sequence
    parallelism over ``sp``; returns the undo.

    ``model`` is a transformers model, or holds some (a LightningModule, a PEFT model): the
    outermost ones are wrapped. Each one's attention function (``config._attn_implementation``:
    sdpa, eager, flash) is wrapped by :func:`ulysses_attention` and registered in transformers'
    attention registry under a name of its own, which that model's config then names: the
    model changes, other models of the process (a reference, a teacher) do not, and no
    module's code is replaced. A registered name that is not a mask kind also tells
    transformers to build no attention mask for the shard (the wrapper masks the whole
    sequence causally). Refuses, naming the fix, what cannot be split: no transformers model,
    encoder-decoders, sliding-window or linear-attention layers, flex and paged attention,
    head counts the group does not divide; and ``generate()`` on the wrapped models raises
    until teardown."""
    n = sp.size
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    models = _outermost(model, pretrained) if pretrained is not None else []
    if not models or not hasattr(transformers, "AttentionInterface"):
        raise ValueError(f"sequence_parallel_size={n}: sequence parallelism wraps the attention of Hugging Face "
                         f"transformers models (through their attention registry); {type(model).__name__} is not "
                         "one and holds none. Use a transformers model, or sequence_parallel_size=1")
    plans = [(m, m.config, m.config._attn_implementation) for m in models]
    for m, config, impl in plans:
        _refuse_unsplittable(config, impl, n)
    undos = []
    for m, config, impl in plans:
        if impl == "eager":
            base = getattr(sys.modules.get(type(m).__module__), "eager_attention_forward", None)
        else:
            base = transformers.AttentionInterface._global_mapping.get(impl)
        if base is None:
            raise ValueError(f"sequence_parallel_size={n}: cannot find the attention function {impl!r} of "
                             f"{type(m).__name__}; load the model with attn_implementation='sdpa' (or 'eager')")
        name = f"zero_ulysses_{impl}_{id(m):x}"
        kind = "eager" if impl == "eager" else attention_kind(base, impl, n)
        transformers.AttentionInterface.register(name, ulysses_attention(base, impl, sp, kind))
        config._attn_implementation = name
        refuse = _refuse_generate(n)
        if hasattr(m, "generate"):
            m.generate = refuse
        undos.append((m, config, impl, name, refuse))

    def undo() -> None:
        for m, config, impl, name, refuse in undos:
            if config._attn_implementation == name:
                config._attn_implementation = impl
            transformers.AttentionInterface._global_mapping.pop(name, None)
            if m.__dict__.get("generate") is refuse:
                del m.__dict__["generate"]

    return undo


def attention_kind(base: Callable, impl: str, n: int) -> str:
    """Which of the wrapper's kinds (``sdpa``, ``flash``) the registered attention function ``base`` is:
    decided by the function, not by its name, so a kernel from the Hub that transformers registers
    with its own flash-attention wrapper (``kernels-community/flash-attn2``, ``flash_attention_3``, ...)
    is wrapped as flash is; any other function (flex, paged, a Hub kernel's own entry point) is
    refused by name: the wrapper knows how sdpa, eager and flash mask causally, not how it does."""
    # already imported with the registry that holds them (this package does not import transformers)
    wrappers = {"sdpa": ("transformers.integrations.sdpa_attention", "sdpa_attention_forward"),
                "flash": ("transformers.integrations.flash_attention", "flash_attention_forward")}
    for kind, (module, function) in wrappers.items():
        if base is not None and base is getattr(sys.modules.get(module), function, None):
            return kind
    raise ValueError(f"sequence_parallel_size={n}: attn_implementation={impl!r} is not supported under sequence "
                     f"parallelism: its function ({getattr(base, '__qualname__', base)!r}) is none of transformers' "
                     "sdpa, eager or flash-attention wrappers, whose causal masking the all-to-all relies on. Load "
                     "the model with attn_implementation='sdpa' (or 'eager', 'flash_attention_2', or a Hub flash "
                     "kernel such as 'kernels-community/flash-attn2')")


def _refuse_generate(n: int) -> Callable:
    """``generate()`` under sequence parallelism would run each rank's whole prompt as a shard
    (and decode one token as N): refused, naming the fix."""
    def generate(*args, **kwargs):
        raise ValueError(f"generate() is not supported on a model set up with sequence_parallel_size={n}: the "
                         "attention expects each rank to hold 1/N of every sequence. Generate with a model set up "
                         "without sequence parallelism (zero_strategy.teardown(model) first, or a copy)")
    return generate


def _outermost(model: nn.Module, kind: type) -> list[nn.Module]:
    """The modules of ``kind`` in ``model`` that no other module of ``kind`` holds."""
    if isinstance(model, kind):
        return [model]
    found: list[nn.Module] = []
    for child in model.children():
        found.extend(_outermost(child, kind))
    return found


def _refuse_unsplittable(config, impl: str, n: int) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    what = type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"sequence_parallel_size={n}: {what} is an encoder-decoder; sequence parallelism splits "
                         "causal decoder-only models. Use sequence_parallel_size=1")
    if impl.startswith(_SP_REFUSED_ATTENTION):
        raise ValueError(f"sequence_parallel_size={n}: attn_implementation={impl!r} is not supported under sequence "
                         "parallelism; load the model with attn_implementation='sdpa' (or 'eager', or flash)")
    kinds = set(getattr(text, "layer_types", None) or ())
    sliding = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
    if sliding or kinds - {"full_attention"}:
        raise ValueError(f"sequence_parallel_size={n}: {what} has sliding-window or linear-attention layers "
                         f"({sorted(kinds) or 'sliding_window'}), which sequence parallelism does not split yet; "
                         "use a model with full attention only, or sequence_parallel_size=1")
    heads = getattr(text, "num_attention_heads", None)
    if isinstance(heads, int):
        check_heads(heads, getattr(text, "num_key_value_heads", None) or heads, n, f" of {what}")


def _engine_generate(engine: "ZeroEngine", original: Callable) -> Callable:
    """See [Note: generate() under stage 3]; gathers once when the engine's policy says so (See
    [Note: gathered for generation] in _model/generation.py), with the training state the config names
    (``offload_states_during_generation``) off the device meanwhile, at every stage."""
    engine_ref = weakref.ref(engine)  # the model holds the wrapper: no cycle through the engine

    def generate(*args, **kwargs):
        engine = engine_ref()
        if engine is None or engine.ended:
            return original(*args, **kwargs)
        with around_generate(engine):
            # held gathered: no collective, except expert parallelism's all-to-alls in every forward
            collective_forwards = engine.expert_parallel is not None or not engine.generation.active
            if kwargs.get("synced_gpus") is None and (engine.plan.shards_parameters or engine.expert_parallel is not None):
                kwargs["synced_gpus"] = engine.comm.world_size > 1 and collective_forwards
            return original(*args, **kwargs)
    return generate


def _merge_gathered(engine: "ZeroEngine", original: Callable) -> Callable:
    """See [Note: PEFT merges under stage 3]."""
    engine_ref = weakref.ref(engine)  # as in _engine_generate: no cycle through the engine

    def merge(*args, **kwargs):
        engine = engine_ref()
        if engine is None or engine.ended:
            return original(*args, **kwargs)
        with modified_on_every_rank(engine):
            return original(*args, **kwargs)
    return merge


def _refuse_resize(original: Callable) -> Callable:
    """See [Note: resize_token_embeddings after setup]."""
    def resize_token_embeddings(new_num_tokens=None, pad_to_multiple_of=None, *args, **kwargs):
        if new_num_tokens is None and pad_to_multiple_of is None:
            return original(new_num_tokens, pad_to_multiple_of, *args, **kwargs)  # only returns the module
        raise RuntimeError(
            "zero_strategy: resize_token_embeddings() on a model that is already set up: the embedding's "
            "flat buffer, shards, fp32 master and optimizer state were sized at setup, so a resize cannot "
            "be kept. Resize first, then set up: call model.resize_token_embeddings(len(tokenizer)) "
            "before zero_strategy.setup(...), accelerator.prepare(...), the Trainer(...) or "
            "trainer.fit(...) (in a LightningModule: in __init__ or configure_model); for PEFT, before "
            "get_peft_model. To resize a set-up model, zero_strategy.teardown(model) it first.")
    return resize_token_embeddings


# -------------------------------------------------------------- the streamed saves
def _save_shadows(module: nn.Module, engine: "ZeroEngine", pretrained, peft_model) -> list:
    """The ``save_pretrained`` shadow of a transformers or PEFT model at stage 3, if ``module`` is one."""
    if peft_model is not None and isinstance(module, peft_model):
        return [(module, "save_pretrained", lambda original: _peft_save(engine, module, original))]
    if pretrained is not None and isinstance(module, pretrained):
        return [(module, "save_pretrained", lambda original: _pretrained_save(engine, module, original))]
    return []


# -------------------------------------------------------------------- transformers
def _pretrained_save(engine: "ZeroEngine", module: nn.Module, original: Callable) -> Callable:
    """See [Note: streamed save_pretrained]."""
    engine_ref, module_ref = weakref.ref(engine), weakref.ref(module)  # the model holds the wrapper

    def save_pretrained(save_directory, *args, dtype: torch.dtype | None = None, **kwargs):
        engine, model = engine_ref(), module_ref()
        streamable = None if engine is None or engine.ended or args else _streamable_names(engine, model, kwargs)
        if streamable is None:
            if dtype is not None and engine is not None and not engine.ended and kwargs.get("state_dict") is None:
                if model is not engine.model:
                    raise ValueError("zero_strategy: save_pretrained(dtype=...) of a submodule of the set-up model "
                                     "is only supported where the save is streamed")
                kwargs["state_dict"] = full_state_dict(engine, False, dtype)  # the library's path, in dtype
            return original(save_directory, *args, **kwargs)
        refuse_while_offloaded(engine.offloaded, "save_pretrained()", ("lp_params", "hp_params"))
        engine.comm.enter("save_pretrained")  # See [Note: bounded waits] in _comm/collectives.py
        original(save_directory, **{**kwargs, "state_dict": {}})  # config files, clean-up of an older save
        main = kwargs.get("is_main_process", True)
        should = getattr(model, "should_save_on_this_rank", None)
        main = should(main) if callable(should) else main
        with whole_model_pass(engine):  # See [Note: releases where a phase ends]
            _write_streamed(engine, model, *streamable, os.fspath(save_directory), main, kwargs, dtype)
    return save_pretrained


def _streamable_names(engine: "ZeroEngine", model: nn.Module, kwargs: dict
                      ) -> tuple[dict[str, torch.Tensor], BatchConversion | None] | None:
    """The entries to write (name -> parameter or buffer) and the conversion of their names and
    layout the library applies on save (None: none), or None where the library's own path must
    run. See [Note: streamed save_pretrained]."""
    if (kwargs.get("state_dict") is not None or kwargs.get("push_to_hub") or kwargs.get("distributed_checkpoint")
            or kwargs.get("safe_serialization", True) is False or getattr(model, "hf_quantizer", None) is not None
            or getattr(model, "_hf_peft_config_loaded", False)):
        return None
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # another transformers than the one this was written for: its own path
        return None
    entries = dict(model.state_dict(keep_vars=True))
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        entries.pop(key, None)
    meta = {k: torch.empty(engine.full_shape(t), dtype=t.dtype, device="meta") for k, t in entries.items()}
    kept = remove_tied_weights_from_state_dict(dict(meta), model)
    if any(k not in meta or kept[k] is not meta[k] for k in kept):
        return None  # the library cloned or made something: not a plain selection
    entries = {k: entries[k] for k in meta if k in kept}
    reverted = revert_weight_conversion(model, dict(kept))
    if set(reverted) == set(kept) and all(reverted[k] is kept[k] for k in kept):
        return entries, None
    convert = functools.partial(revert_weight_conversion, model)  # held for this save only
    by_batch = arrival_specs(engine, entries, None, convert)
    whole = {k: (t.dtype, list(t.shape)) for k, t in reverted.items()}
    if len(by_batch) != len(whole) or any(whole.get(n) != (d, s) for n, d, s in by_batch):
        return None  # a conversion across units: needs every tensor at once. See [Note: converted saves]
    return entries, convert


def _shard_plan(specs: list[tuple[str, torch.dtype, list[int]]], max_shard_size) -> list[list[int]]:
    """Indices of ``specs`` per file, with huggingface_hub's rule: in order, a new file when the next
    tensor would pass the limit, a tensor bigger than the limit alone in its own file."""
    limit = _size_in_bytes(max_shard_size)
    files: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (_, dtype, shape) in enumerate(specs):
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if n > limit:
            files.append([i])
            continue
        if size + n > limit and current:
            files.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current or not files:
        files.append(current)
    return files


_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _size_in_bytes(size) -> int:
    """``max_shard_size`` as transformers reads it: an int, or a number and a unit ("5GB", "500MiB")."""
    if not isinstance(size, str):
        return int(size)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
    unit = match.group(2).upper() if match else None
    if unit not in _SIZE_UNITS and unit != "":
        raise ValueError(f"zero_strategy: max_shard_size={size!r} is not a size such as '5GB' or '500MiB'")
    return int(float(match.group(1)) * _SIZE_UNITS[unit or "B"])


def _add_variant(name: str, variant: str | None) -> str:
    """transformers' file name with a variant: ``model.safetensors`` -> ``model.<variant>.safetensors``."""
    if not variant:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def _write_streamed(engine: "ZeroEngine", model: nn.Module, entries: dict[str, torch.Tensor],
                    convert: BatchConversion | None, directory: str, main: bool, kwargs: dict,
                    dtype: torch.dtype | None) -> None:
    """Split ``entries`` (under the names ``convert`` gives) into files with the library's rule, in the
    order they arrive, and write them unit by unit (main only), with the index where there is more
    than one file."""
    specs = arrival_specs(engine, entries, dtype, convert)
    files = _shard_plan(specs, kwargs.get("max_shard_size", "50GB"))
    variant = kwargs.get("variant")
    weights = _add_variant(WEIGHTS_NAME, variant)
    names = ([weights] if len(files) == 1 else
             [weights.replace(".safetensors", f"-{i + 1:05d}-of-{len(files):05d}.safetensors")
              for i in range(len(files))])
    file_of = {specs[i][0]: names[f] for f, idx in enumerate(files) for i in idx}
    write_entries(engine, entries, directory, main, file_of, names, dtype, convert)
    if not main or len(files) == 1:
        return
    if os.path.isfile(os.path.join(directory, weights)):
        os.remove(os.path.join(directory, weights))  # the empty file of the library's own call
    total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s in specs)
    index = {"metadata": {"total_parameters": model.num_parameters(), "total_size": total},
             "weight_map": file_of}
    with open(os.path.join(directory, _add_variant(INDEX_NAME, variant)), "w", encoding="utf-8") as fh:
        fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------- PEFT
def _peft_save(engine: "ZeroEngine", module: nn.Module, original: Callable) -> Callable:
    """See [Note: streamed adapter saves]."""
    engine_ref, module_ref = weakref.ref(engine), weakref.ref(module)

    def save_pretrained(save_directory, *args, **kwargs):
        engine, model = engine_ref(), module_ref()
        if engine is None or engine.ended or args or kwargs.get("state_dict") is not None:
            return original(save_directory, *args, **kwargs)
        refuse_while_offloaded(engine.offloaded, "PeftModel.save_pretrained()", ("lp_params", "hp_params"))
        engine.comm.enter("save_pretrained")
        selected = kwargs.get("selected_adapters") or list(getattr(model, "peft_config", {}) or ["default"])
        embeddings = may_save_embeddings(model, selected, kwargs.get("save_embedding_layers", "auto"))
        kwargs["state_dict"] = adapter_state_dict(engine, model, set(selected), embeddings)
        return original(save_directory, **kwargs)
    return save_pretrained


def adapter_values(engine: "ZeroEngine", adapters: list[str] | None, save_embedding_layers,
                   dtype: torch.dtype | None, what: str) -> dict[str, torch.Tensor]:
    """``zero_strategy.api.adapter_state_dict``: :func:`adapter_state_dict` of the set-up model for
    ``adapters`` (None: all it has), with the embeddings where the save may keep them."""
    refuse_while_offloaded(engine.offloaded, what, ("lp_params", "hp_params"))
    engine.comm.enter(what)
    model = engine.model
    selected = list(adapters or getattr(model, "peft_config", {}) or ["default"])
    embeddings = may_save_embeddings(model, selected, save_embedding_layers)
    return adapter_state_dict(engine, model, set(selected), embeddings, dtype)


def may_save_embeddings(model: nn.Module, adapters: list[str], flag) -> bool:
    """Whether PEFT's ``get_peft_model_state_dict`` may keep the embedding layers: ``True``, or
    ``"auto"`` where an embedding is a target or the base model names where it came from (PEFT
    then compares vocabulary sizes). Erring on yes only costs gathering the embeddings' units."""
    if flag != "auto":
        return bool(flag)
    names = ("embed_tokens", "lm_head", "embed_in", "embed_out", "word_embeddings")
    for name in adapters:
        config = getattr(model, "peft_config", {}).get(name)
        if config is None or getattr(config, "base_model_name_or_path", None):
            return True
        if any(n in str(getattr(config, "target_modules", "") or "") for n in names):
            return True
    return False


def adapter_state_dict(engine: "ZeroEngine", model: nn.Module, adapters: set[str], embeddings: bool,
                       dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Host copies of the entries of ``model.state_dict()`` an adapter save can keep, gathering only
    the units holding them. See [Note: streamed adapter saves]. Floating tensors in ``dtype``
    (None: the compute dtype, as ``state_dict()`` gives; ``torch.float32``: the fp32 masters, as
    ``full_state_dict`` gives)."""
    try:
        from peft.utils.other import EMBEDDING_LAYER_NAMES
    except ImportError:
        EMBEDDING_LAYER_NAMES = ["embed_tokens", "lm_head", "embed_in", "embed_out", "word_embeddings"]
    params = {id(p) for p in model.parameters()}
    out: dict[str, torch.Tensor] = {}
    wanted: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        parts = set(name.split("."))
        if id(t) not in params:  # a buffer
            out[name] = t.detach().to("cpu", out_dtype(t, dtype), copy=True)
        elif (parts & adapters or t.requires_grad
              or (embeddings and any(e in parts for e in EMBEDDING_LAYER_NAMES))):
            wanted.setdefault(id(t), []).append(name)
    for pid in [pid for pid in wanted if pid not in engine.managed]:  # integer parameters: not managed
        t = next(p for p in model.parameters() if id(p) == pid)
        for name in wanted.pop(pid):
            out[name] = t.detach().to("cpu", copy=True)
    for _, values in unit_values(engine, set(wanted), True, lambda g: dtype or g.compute_dtype):
        for pid, v in values.items():
            for name in wanted[pid]:
                out[name] = v
    sd_order = list(model.state_dict(keep_vars=True))
    return {k: out[k] for k in sd_order if k in out}
