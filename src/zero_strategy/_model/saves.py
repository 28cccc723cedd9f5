"""The model's weights written into safetensors files unit by unit, whatever library the model is from.

The generic half of the streamed saves: which tensor arrives when (:func:`arrival_specs`),
and the writing of each file as its tensors arrive (:func:`write_entries`), used by
``zero_strategy.api.write_safetensors`` (the Accelerate front end's ``save_model``) and by the
streamed ``save_pretrained`` of _model/hf.py. See [Note: streamed save_pretrained] in
_model/hf.py for why unit by unit: the writing rank holds one unit's host copies, the device
one group beyond its shards, the other ranks nothing.

[Note: converted saves]
A library may save a model under other names and in another layout than its parameters
have: transformers 5 fuses a mixture-of-experts layer's experts into one
``experts.gate_up_proj`` at load and writes them back one tensor per expert
(``experts.0.w1.weight``, ...). Such a conversion is given here per batch of arrival (the
loose tensors, then each unit), on the values of that batch only, so the save stays one
unit at a time; the headers, written first, come from the same conversion run on meta
tensors. The caller vouches that converting batch by batch gives what converting the
whole state dict would (_model/hf.py compares the two on meta tensors).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

import torch

from .._engine.engine import refuse_while_offloaded
from .._mechanisms.safetensors_writer import StreamWriter
from .gather import sole_keeper, unit_values

if TYPE_CHECKING:
    from .._engine.engine import ZeroEngine


def out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype an entry is written in: ``dtype`` for floating tensors where given, else its own."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


#: convert(batch: name -> tensor) -> name -> tensor: the names a library saves under, applied to
#: each batch of :func:`arrival_batches` (None: the names as they are). See [Note: converted saves].
BatchConversion = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


def arrival_batches(engine: "ZeroEngine", entries: dict[str, torch.Tensor]) -> list[list[str]]:
    """The names of ``entries`` in the batches :func:`write_entries` has their values in: the tensors
    the engine does not manage (buffers, integer parameters) first, then one batch per unit."""
    managed = engine.managed
    by_param: dict[int, list[str]] = {}
    for name, t in entries.items():
        by_param.setdefault(id(t), []).append(name)
    loose = [n for n, t in entries.items() if id(t) not in managed]
    return [loose] + [[n for g in u.groups for s in g.slots for n in by_param.get(id(s.param), ())]
                      for u in engine.units]


def arrival_specs(engine: "ZeroEngine", entries: dict[str, torch.Tensor], dtype: torch.dtype | None,
                  convert: BatchConversion | None = None) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of each tensor :func:`write_entries` writes, in the order it writes them:
    the batches of :func:`arrival_batches`, each through ``convert`` (run on meta tensors: nothing
    is gathered). See [Note: converted saves]."""
    specs = []
    for batch in arrival_batches(engine, entries):
        meta = {n: torch.empty(engine.full_shape(entries[n]), dtype=out_dtype(entries[n], dtype), device="meta")
                for n in batch}
        out = convert(meta) if convert is not None and meta else meta
        specs.extend((n, t.dtype, list(t.shape)) for n, t in out.items())
    return specs


def write_entries(engine: "ZeroEngine", entries: dict[str, torch.Tensor], directory: str, main: bool,
                  file_of: dict[str, str], files: list[str], dtype: torch.dtype | None,
                  convert: BatchConversion | None = None) -> None:
    """Gather unit by unit and append each entry (name -> parameter or buffer) to the safetensors
    file ``file_of[name]`` names in ``directory`` (main only: the other ranks take part in the
    gathers, sending their shards to the one that writes, and keep nothing). Each file's header
    lists its tensors in the order they arrive
    (:func:`arrival_specs`); a file is closed once its last tensor is written, and a name in
    ``files`` no entry falls in is written empty, as the library writes an empty state dict.
    Floating entries are written in ``dtype`` (None: the model's compute dtype, as ``state_dict()``
    gives), from the fp32 masters where a group trains. ``convert``: each unit's entries are
    written under the names and in the layout it gives (``file_of`` names those). See [Note:
    streamed save_pretrained] and [Note: converted saves]."""
    batches = arrival_batches(engine, entries)
    managed = {id(entries[n]) for batch in batches for n in batch} & engine.managed.keys()
    specs: dict[str, list[tuple[str, torch.dtype, list[int]]]] = {f: [] for f in files}
    for spec in arrival_specs(engine, entries, dtype, convert):
        specs.setdefault(file_of[spec[0]], []).append(spec)
    left = {f: len(s) for f, s in specs.items()}
    writers: dict[str, StreamWriter] = {}

    def write(batch: dict[str, torch.Tensor]) -> None:
        for name, t in (convert(batch) if convert is not None and batch else batch).items():
            f = file_of[name]
            if f not in writers:
                writers[f] = StreamWriter(os.path.join(directory, f), specs[f], {"format": "pt"},
                                          held_by=engine.background_save)
            writers[f].write(name, t.contiguous())
            left[f] -= 1
            if left[f] == 0:
                writers[f].close()

    try:
        if main:
            write({n: entries[n].detach().to("cpu", out_dtype(entries[n], dtype)) for n in batches[0]})
        to = sole_keeper(engine.comm, main)
        by_unit = {id(u): names for u, names in zip(engine.units, batches[1:])}
        for unit, values in unit_values(engine, managed, main, lambda g: dtype or g.compute_dtype, to):
            if main:
                write({n: values[id(entries[n])] for n in by_unit[id(unit)]})
            del values  # See [Note: streamed save_pretrained]: one unit's copies at a time
        for f in (f for f, s in specs.items() if not s) if main else ():
            writers[f] = StreamWriter(os.path.join(directory, f), [], {"format": "pt"}, held_by=engine.background_save)
            writers[f].close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise


def write_files(engine: "ZeroEngine", directory: str, file_of: dict[str, str], files: list[str], write: bool,
                dtype: torch.dtype | None, what: str) -> None:
    """``zero_strategy.api.write_safetensors``: the entries of ``engine.model.state_dict()`` that
    ``file_of`` names, written unit by unit into the files it assigns them (``write``: this rank
    writes; the others only send their shards to it)."""
    refuse_while_offloaded(engine.offloaded, what, ("lp_params", "hp_params"))
    engine.comm.enter(what)  # See [Note: bounded waits] in _comm/collectives.py
    named = engine.model.state_dict(keep_vars=True)
    write_entries(engine, {n: named[n] for n in file_of}, directory, write, file_of, files, dtype)
