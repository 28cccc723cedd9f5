"""The model's weights written into safetensors files unit by unit, whatever library the model is from.

The generic half of the streamed saves: which tensor arrives when (:func:`arrival_order`),
and the writing of each file as its tensors arrive (:func:`write_entries`), used by
``zero_strategy.api.write_safetensors`` (the Accelerate front end's ``save_model``) and by the
streamed ``save_pretrained`` of _model/hf.py. See [Note: streamed save_pretrained] in
_model/hf.py for why unit by unit: the writing rank holds one unit's host copies, the device
one group beyond its shards, the other ranks nothing.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from .._engine.engine import refuse_while_offloaded
from .._mechanisms.safetensors_writer import StreamWriter
from .gather import sole_keeper, unit_values

if TYPE_CHECKING:
    from .._engine.engine import ZeroEngine


def out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype an entry is written in: ``dtype`` for floating tensors where given, else its own."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def arrival_order(engine: "ZeroEngine", entries: dict[str, torch.Tensor]) -> list[str]:
    """The names of ``entries`` in the order :func:`write_entries` has their values: the tensors the
    engine does not manage (buffers, integer parameters) first, then unit by unit."""
    managed = engine.managed
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
    order = arrival_order(engine, entries)
    managed = {id(entries[n]) for n in order} & engine.managed.keys()
    by_param: dict[int, list[str]] = {}
    for n in order:
        by_param.setdefault(id(entries[n]), []).append(n)
    specs: dict[str, list[tuple[str, torch.dtype, list[int]]]] = {f: [] for f in files}
    for n in order:
        t = entries[n]
        specs.setdefault(file_of[n], []).append((n, out_dtype(t, dtype), list(engine.full_shape(t))))
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


def write_files(engine: "ZeroEngine", directory: str, file_of: dict[str, str], files: list[str], write: bool,
                dtype: torch.dtype | None, what: str) -> None:
    """``zero_strategy.api.write_safetensors``: the entries of ``engine.model.state_dict()`` that
    ``file_of`` names, written unit by unit into the files it assigns them (``write``: this rank
    writes; the others only send their shards to it)."""
    refuse_while_offloaded(engine.offloaded, what, ("lp_params", "hp_params"))
    engine.comm.enter(what)  # See [Note: bounded waits] in _comm/waits.py
    named = engine.model.state_dict(keep_vars=True)
    write_entries(engine, {n: named[n] for n in file_of}, directory, write, file_of, files, dtype)
