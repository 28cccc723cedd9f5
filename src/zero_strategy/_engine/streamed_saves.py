"""``save_pretrained`` of a set-up transformers or PEFT model at stage 3, unit by unit.

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
adapter-carrying model, or a model whose saved names the library converts
(``revert_weight_conversion`` renames or merges something).

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

import json
import os
import re
import weakref
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from .passes import whole_model_pass
from .._mechanisms.safetensors_writer import StreamWriter
from .gather import full_state_dict, group_values
from .offload_states import refuse_while_offloaded

if TYPE_CHECKING:
    from .engine import ZeroEngine
    from .units import Unit

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def unit_values(engine: "ZeroEngine", wanted: set[int], keep: bool,
                dtype: Callable[[object], torch.dtype | None],
                to: int | None = None) -> Iterator[tuple["Unit", dict[int, torch.Tensor]]]:
    """For each unit holding a parameter in ``wanted`` (ids), in the engine's order: the unit and
    id(param) -> host copy of those of its parameters (``{}`` where not ``keep``). The caller
    drops each dict before asking for the next; ``dtype(group)``: the dtype to copy it in;
    ``to``: the one rank that keeps (``gather.group_values``)."""
    for unit in engine.units:
        groups = [g for g in unit.groups if any(id(s.param) in wanted for s in g.slots)]
        if not groups:
            continue
        values: dict[int, torch.Tensor] = {}
        for g in groups:
            values.update((pid, t) for pid, t in group_values(engine, g, keep, dtype(g), to).items()
                          if pid in wanted)
        yield unit, values
        del values  # before the next unit is gathered (the caller drops its reference too)


def install_saves(module: nn.Module, engine: "ZeroEngine", pretrained, peft_model, shadow) -> list:
    """Shadow ``save_pretrained`` of a transformers or PEFT model at stage 3; returns the undo callbacks."""
    if not any(u.sharded_groups for u in engine.units):
        return []
    if peft_model is not None and isinstance(module, peft_model):
        return [shadow(module, "save_pretrained", lambda original: _peft_save(engine, module, original))]
    if pretrained is not None and isinstance(module, pretrained):
        return [shadow(module, "save_pretrained", lambda original: _pretrained_save(engine, module, original))]
    return []


# -------------------------------------------------------------------- transformers
def _pretrained_save(engine: "ZeroEngine", module: nn.Module, original: Callable) -> Callable:
    """See [Note: streamed save_pretrained]."""
    engine_ref, module_ref = weakref.ref(engine), weakref.ref(module)  # the model holds the wrapper

    def save_pretrained(save_directory, *args, dtype: torch.dtype | None = None, **kwargs):
        engine, model = engine_ref(), module_ref()
        names = None if engine is None or engine.ended or args else _streamable_names(engine, model, kwargs)
        if names is None:
            if dtype is not None and engine is not None and not engine.ended and kwargs.get("state_dict") is None:
                if model is not engine.model:
                    raise ValueError("zero_strategy: save_pretrained(dtype=...) of a submodule of the set-up model "
                                     "is only supported where the save is streamed")
                kwargs["state_dict"] = full_state_dict(engine, False, dtype)  # the library's path, in dtype
            return original(save_directory, *args, **kwargs)
        refuse_while_offloaded(engine, "save_pretrained()", ("lp_params", "hp_params"))
        engine.comm.enter("save_pretrained")  # See [Note: bounded waits] in _comm/waits.py
        original(save_directory, **{**kwargs, "state_dict": {}})  # config files, clean-up of an older save
        main = kwargs.get("is_main_process", True)
        should = getattr(model, "should_save_on_this_rank", None)
        main = should(main) if callable(should) else main
        with whole_model_pass(engine):  # See [Note: freed host memory]
            _write_streamed(engine, model, names, os.fspath(save_directory), main, kwargs, dtype)
    return save_pretrained


def _streamable_names(engine: "ZeroEngine", model: nn.Module, kwargs: dict) -> dict[str, torch.Tensor] | None:
    """The entries to write (name -> parameter or buffer), or None where the library's own path
    must run. See [Note: streamed save_pretrained]."""
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
    shapes = {id(s.param): s.shape for g in engine.groups for s in g.slots}
    meta = {k: torch.empty(shapes.get(id(t), t.shape), dtype=t.dtype, device="meta") for k, t in entries.items()}
    kept = remove_tied_weights_from_state_dict(dict(meta), model)
    if any(k not in meta or kept[k] is not meta[k] for k in kept):
        return None  # the library cloned or made something: not a plain selection
    reverted = revert_weight_conversion(model, dict(kept))
    if set(reverted) != set(kept) or any(reverted[k] is not kept[k] for k in kept):
        return None  # renamed or merged on save: needs every tensor at once
    return {k: entries[k] for k in meta if k in kept}


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


def _write_streamed(engine: "ZeroEngine", model: nn.Module, entries: dict[str, torch.Tensor], directory: str,
                    main: bool, kwargs: dict, dtype: torch.dtype | None) -> None:
    """Split ``entries`` into files with the library's rule, in the order they arrive, and write them
    unit by unit (main only), with the index where there is more than one file."""
    shapes = {id(s.param): s.shape for g in engine.groups for s in g.slots}
    order = arrival_order(engine, entries)
    specs = [(n, out_dtype(entries[n], dtype), list(shapes.get(id(entries[n]), entries[n].shape))) for n in order]
    files = _shard_plan(specs, kwargs.get("max_shard_size", "50GB"))
    variant = kwargs.get("variant")
    weights = _add_variant(WEIGHTS_NAME, variant)
    names = ([weights] if len(files) == 1 else
             [weights.replace(".safetensors", f"-{i + 1:05d}-of-{len(files):05d}.safetensors")
              for i in range(len(files))])
    file_of = {specs[i][0]: names[f] for f, idx in enumerate(files) for i in idx}
    write_entries(engine, entries, directory, main, file_of, names, dtype)
    if not main or len(files) == 1:
        return
    if os.path.isfile(os.path.join(directory, weights)):
        os.remove(os.path.join(directory, weights))  # the empty file of the library's own call
    total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s in specs)
    index = {"metadata": {"total_parameters": model.num_parameters(), "total_size": total},
             "weight_map": file_of}
    with open(os.path.join(directory, _add_variant(INDEX_NAME, variant)), "w", encoding="utf-8") as fh:
        fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype an entry is written in: ``dtype`` for floating tensors where given, else its own."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def arrival_order(engine: "ZeroEngine", entries: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``entries`` in the order :func:`write_entries` has their values: the tensors the
    engine does not manage (buffers, integer parameters) first, then unit by unit."""
    managed = {id(s.param) for g in engine.groups for s in g.slots}
    by_param: dict[int, list[str]] = {}
    for name, t in entries.items():
        by_param.setdefault(id(t), []).append(name)
    loose = [n for n, t in entries.items() if id(t) not in managed]
    return loose + [n for u in engine.units for g in u.groups for s in g.slots for n in by_param.get(id(s.param), ())]


def write_entries(engine: "ZeroEngine", entries: dict[str, torch.Tensor], directory: str, main: bool,
                  file_of: dict[str, str], files: list[str], dtype: torch.dtype | None) -> None:
    """Gather unit by unit and append each entry (name -> parameter or buffer) to the safetensors
    file ``file_of[name]`` names in ``directory`` (main only: the other ranks take part in the
    gathers, sending their shards to the one that writes, and keep nothing). Each file's header
    lists its tensors in the order they arrive
    (:func:`arrival_order`); a file is closed once its last tensor is written, and a name in
    ``files`` no entry falls in is written empty, as the library writes an empty state dict.
    Floating entries are written in ``dtype`` (None: the model's compute dtype, as ``state_dict()``
    gives), from the fp32 masters where a group trains. See [Note: streamed save_pretrained]."""
    shapes = {id(s.param): s.shape for g in engine.groups for s in g.slots}
    order = arrival_order(engine, entries)
    managed = {id(entries[n]) for n in order} & shapes.keys()
    by_param: dict[int, list[str]] = {}
    for n in order:
        by_param.setdefault(id(entries[n]), []).append(n)
    specs: dict[str, list[tuple[str, torch.dtype, list[int]]]] = {f: [] for f in files}
    for n in order:
        t = entries[n]
        specs.setdefault(file_of[n], []).append((n, out_dtype(t, dtype), list(shapes.get(id(t), t.shape))))
    left = {f: len(s) for f, s in specs.items()}
    writers: dict[str, StreamWriter] = {}

    def write(name: str, t: torch.Tensor) -> None:
        f = file_of[name]
        if f not in writers:
            writers[f] = StreamWriter(os.path.join(directory, f), specs[f], {"format": "pt"})
        writers[f].write(name, t.contiguous())
        left[f] -= 1
        if left[f] == 0:
            writers[f].close()

    try:
        for n in (n for n in order if id(entries[n]) not in managed) if main else ():
            write(n, entries[n].detach().to("cpu", out_dtype(entries[n], dtype)))
        to = sole_keeper(engine.comm, main)
        for unit, values in unit_values(engine, managed, main, lambda g: dtype or g.compute_dtype, to):
            for s in (s for g in unit.groups for s in g.slots):
                for n in by_param.get(id(s.param), ()) if main else ():
                    write(n, values[id(s.param)])
            del values  # See [Note: streamed save_pretrained]: one unit's copies at a time
        for f in (f for f, s in specs.items() if not s) if main else ():
            writers[f] = StreamWriter(os.path.join(directory, f), [], {"format": "pt"})
            writers[f].close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise


def sole_keeper(comm, keep: bool) -> int | None:
    """The group rank a gather should go to when at most one rank keeps what it gathers (a save
    that one rank writes; the rank of the lowest number where none does), so the others hold
    nothing beyond their shards; None when several keep. One small collective."""
    if comm.world_size == 1:
        return None
    keepers = [r for r, k in enumerate(comm.all_gather_object(bool(keep), label="keepers")) if k]
    return keepers[0] if len(keepers) == 1 else (0 if not keepers else None)


def write_files(engine: "ZeroEngine", directory: str, file_of: dict[str, str], files: list[str], write: bool,
                dtype: torch.dtype | None, what: str) -> None:
    """``zero_strategy.api.write_safetensors``: the entries of ``engine.model.state_dict()`` that
    ``file_of`` names, written unit by unit into the files it assigns them (``write``: this rank
    writes; the others only send their shards to it)."""
    refuse_while_offloaded(engine, what, ("lp_params", "hp_params"))
    engine.comm.enter(what)  # See [Note: bounded waits] in _comm/waits.py
    named = engine.model.state_dict(keep_vars=True)
    write_entries(engine, {n: named[n] for n in file_of}, directory, write, file_of, files, dtype)


# ---------------------------------------------------------------------------- PEFT
def _peft_save(engine: "ZeroEngine", module: nn.Module, original: Callable) -> Callable:
    """See [Note: streamed adapter saves]."""
    engine_ref, module_ref = weakref.ref(engine), weakref.ref(module)

    def save_pretrained(save_directory, *args, **kwargs):
        engine, model = engine_ref(), module_ref()
        if engine is None or engine.ended or args or kwargs.get("state_dict") is not None:
            return original(save_directory, *args, **kwargs)
        refuse_while_offloaded(engine, "PeftModel.save_pretrained()", ("lp_params", "hp_params"))
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
    refuse_while_offloaded(engine, what, ("lp_params", "hp_params"))
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
    grouped = {id(s.param) for g in engine.groups for s in g.slots}
    for pid in [pid for pid in wanted if pid not in grouped]:  # integer parameters: not managed
        t = next(p for p in model.parameters() if id(p) == pid)
        for name in wanted.pop(pid):
            out[name] = t.detach().to("cpu", copy=True)
    for _, values in unit_values(engine, set(wanted), True, lambda g: dtype or g.compute_dtype):
        for pid, v in values.items():
            for name in wanted[pid]:
                out[name] = v
    sd_order = list(model.state_dict(keep_vars=True))
    return {k: out[k] for k in sd_order if k in out}
