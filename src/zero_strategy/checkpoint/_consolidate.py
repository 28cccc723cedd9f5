"""Consolidate a sharded checkpoint into one full state dict, streaming, in one process.

It reads our own checkpoints and, with the same outputs, a torch.distributed.checkpoint (DCP)
directory of an FSDP2 or torchtitan run (its model entries; See [Note: DCP's layout] in _dcp.py).

[Note: bounded memory]
Nothing is loaded whole. Each output tensor is assembled directly in the output
file: its elements are read from the rank files that hold them in chunks of at
most ``CHUNK_BYTES``, cast, and appended by the streaming safetensors writer.
Peak host memory is a few chunks plus Python and torch, whatever the model size
(the ``torch`` format is the exception: ``torch.save`` needs the whole state dict
in memory). No ``torch.distributed`` is needed. Expert parallelism's fused experts are streamed
the same way, expert by expert (:class:`_ExpertSource`).

Output: a directory ``out`` with ``model.safetensors`` (keys exactly as
``model.state_dict()``, tied parameters under each of their names, buffers
included), or ``model-0000i-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (the Hugging Face sharded layout) when
``max_shard_size`` is given, or ``pytorch_model.bin``. With ``hf_config`` the
Hugging Face ``config.json`` (and tokenizer files beside it) are copied so
``from_pretrained(out)`` works. It is built in a temporary directory renamed
into place, so an interrupted run leaves no partial ``out``; the temporary directory
is removed on any error or interrupt, and one left by a killed run is removed by the
next run to the same ``out`` (see [Note: what a save may delete] in _owned.py).

[Note: a lying checkpoint cannot grow memory]
Before anything is written, the metadata is validated (_validate.py) and every file's
digest and safetensors header are checked against it, so every element count the
metadata claims is backed by bytes on disk. The streamed formats then hold at most
a few ``CHUNK_BYTES`` pieces; ``torch`` needs the whole output in memory, which is
computed from the validated layout and refused up front when it exceeds the memory
available (``MemAvailable``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import torch

from ._dcp import DCPCheckpoint, is_dcp_checkpoint
from ._layout import BUFFERS_FILE, CheckpointError, Metadata, dtype_from_name
from ._experts import expert_files, expert_pieces
from ._load import resolve_checkpoint_dir
from ._metadata_io import read_metadata
from ._owned import OwnedDir, remove_leftovers
from ._safetensors_stream import StreamReader, StreamWriter, verify_file
from ._validate import check_buffers_file, check_experts_file, check_rank_file

CHUNK_BYTES = 16 << 20
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
            "added_tokens.json", "chat_template.jinja")
_DTYPE_ARGS = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
               "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_size(size: int | str | None) -> int | None:
    """``5GB`` -> 5e9 bytes (as Hugging Face counts), ``500MiB`` -> 500 * 2**20, ints unchanged."""
    if size is None or isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m:
        raise CheckpointError(f"max_shard_size {size!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def _as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_ARGS[str(dtype).lower()]
    except KeyError:
        raise CheckpointError(f"dtype {dtype!r}: use fp32, bf16 or fp16") from None


class _Source:
    """Where one output tensor comes from: a parameter's pieces in rank files, or a buffer."""

    def __init__(self, key: str, kind: str, name: str, meta: Metadata, readers, tensor_name):
        self.key, self.kind, self.name = key, kind, name
        self.meta, self.readers, self.tensor_name = meta, readers, tensor_name
        if kind == "param":
            p = meta.params[name]
            group = meta.groups[p.group]
            self.shape, self.dtype = list(p.shape), dtype_from_name(group.dtype)
        else:
            reader = readers(BUFFERS_FILE)
            self.shape, self.dtype = reader.shape(name), reader.dtype(name)

    @property
    def numel(self) -> int:
        n = 1
        for x in self.shape:
            n *= x
        return n

    def chunks(self):
        """Yield consecutive flat pieces of the tensor, at most CHUNK_BYTES each."""
        step = max(1, CHUNK_BYTES // torch.empty((), dtype=self.dtype).element_size())
        if self.kind == "buffer":
            reader = self.readers(BUFFERS_FILE)
            for a in range(0, self.numel, step):
                yield reader.read(self.name, a, min(a + step, self.numel))
            return
        group = self.meta.groups[self.meta.params[self.name].group]
        for rank, a, b, _ in self.meta.pieces(self.name, 0, self.numel):
            reader = self.readers(self.meta.rank_file(rank))
            for c in range(a, b, step):
                yield reader.read(self.tensor_name(group), c, min(c + step, b))


class _ExpertSource:
    """A fused experts parameter ``[E, ...]`` of an expert-parallel checkpoint (or, with ``suffix``
    ``".state.<key>"``, one of its optimizer-state tensors), rebuilt from the one-expert tensors of the
    experts files (See [Note: experts in a checkpoint] in _experts.py). Laid end to end in expert order
    they are its flat elements, so it streams like a parameter: pieces of at most CHUNK_BYTES, never the
    fused tensor in memory. The output holds it under the same name a run without expert parallelism
    writes (the model's own, e.g. ``model.layers.0.mlp.experts.gate_up_proj``)."""

    def __init__(self, key: str, fqn: str, meta: Metadata, readers, suffix: str = "",
                 dtype: torch.dtype | None = None):
        desc = meta.experts["params"][fqn]
        self.key, self.kind, self.name, self.readers = key, "expert", fqn + suffix, readers
        self.shape = [desc["num_experts"], *desc["shape"]]
        self.dtype = dtype if dtype is not None else dtype_from_name(desc["dtype"])
        self.numel = math.prod(self.shape)
        self.pieces = expert_pieces(meta.experts, fqn, suffix)

    def chunks(self):
        step = max(1, CHUNK_BYTES // torch.empty((), dtype=self.dtype).element_size())
        for file, name, numel in self.pieces:
            reader = self.readers(file)
            for a in range(0, numel, step):
                yield reader.read(name, a, min(a + step, numel))


def _source(key: str, kind: str, name: str, meta: Metadata, readers):
    """The source of one ``state_dict_keys`` entry's weights."""
    if kind == "expert":
        return _ExpertSource(key, name, meta, readers)
    return _Source(key, kind, name, meta, readers, lambda g: g.weight_tensor)


def verify_checkpoint_files(ckpt: Path, meta: Metadata) -> None:
    """Every file of the checkpoint against its metadata (digest, size, header), before any output is
    written (See [Note: a lying checkpoint cannot grow memory]); export_checkpoint checks the same."""
    experts = expert_files(meta.experts) if meta.experts is not None else {}
    for rec in meta.files:
        verify_file(ckpt / rec.name, rec.digest, rec.bytes)
        if rec.name in experts:
            check_experts_file(ckpt / rec.name, meta)
        elif rec.rank is not None:
            check_rank_file(ckpt / rec.name, meta)
        elif rec.name == BUFFERS_FILE:
            check_buffers_file(ckpt / rec.name, meta)


def _out_dtype(src: _Source, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and src.dtype.is_floating_point else src.dtype


def consolidate(ckpt_dir: str | os.PathLike, out: str | os.PathLike, dtype=None, format: str = "safetensors",
                max_shard_size: int | str | None = None, include_optimizer: bool = False,
                hf_config: str | os.PathLike | None = None) -> Path:
    """Write the full model of a sharded checkpoint to the new directory ``out``; return its path.

    ``dtype``: fp32/bf16/fp16 (or a torch dtype) for floating tensors; None keeps the
    stored dtype (fp32 for trained weights, which come from the masters). ``format``:
    ``"safetensors"`` (streamed) or ``"torch"`` (``pytorch_model.bin``; needs memory for
    the whole model). ``max_shard_size`` (e.g. ``"5GB"``): split safetensors output with an
    index file. ``include_optimizer``: also write ``optimizer.safetensors`` (per-parameter
    state, ``<name>.<key>``). ``hf_config``: a Hugging Face model directory (or its
    config.json) whose config and tokenizer files are copied into ``out``.
    """
    ckpt = resolve_checkpoint_dir(ckpt_dir)
    out = Path(out).absolute()
    if out.exists() or out.is_symlink():
        raise CheckpointError(f"output path {out} exists; refusing to overwrite it (choose a new path)")
    if format not in ("safetensors", "torch"):
        raise CheckpointError(f"format {format!r}: use 'safetensors' or 'torch'")
    dtype = _as_dtype(dtype)
    limit = parse_size(max_shard_size)
    if limit is not None and format != "safetensors":
        raise CheckpointError("max_shard_size applies to the safetensors format only")
    hf_files = _hf_files(hf_config) if hf_config is not None else []
    if not (ckpt / "metadata.json").exists() and is_dcp_checkpoint(ckpt):
        if include_optimizer:
            raise CheckpointError(f"{ckpt} is a DCP checkpoint, whose optimizer state is not consolidated: drop "
                                  "include_optimizer/--optimizer (resume it with load_checkpoint to carry it over)")
        return _write(out, _dcp_sources(ckpt), dtype, format, limit, hf_files, None, None)
    meta = read_metadata(ckpt)
    verify_checkpoint_files(ckpt, meta)
    if include_optimizer and meta.optimizer is None:
        raise CheckpointError(f"{ckpt} was saved without optimizer state; drop include_optimizer/--optimizer")

    readers: dict[str, StreamReader] = {}

    def reader(name: str) -> StreamReader:
        if name not in readers:
            readers[name] = StreamReader(ckpt / name)
        return readers[name]

    sources = [_source(key, kind, name, meta, reader) for key, kind, name in meta.state_dict_keys]
    try:
        return _write(out, sources, dtype, format, limit, hf_files, meta if include_optimizer else None, reader)
    finally:
        for r in readers.values():
            r.close()


def _write(out: Path, sources: list, dtype, format: str, limit: int | None, hf_files: list[Path],
           optimizer_of: Metadata | None, reader) -> Path:
    """The output directory, built beside ``out`` and renamed into place."""
    if format == "torch":
        _check_memory(sources, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out.parent, (f".{out.name}.tmp-",))  # of a killed run to the same out
    owned = OwnedDir.create(out.parent, f".{out.name}.tmp-")
    tmp = owned.path
    try:
        if format == "torch":
            _write_torch(tmp, sources, dtype)
        else:
            _write_safetensors(tmp, sources, dtype, limit)
        if optimizer_of is not None:
            _write_optimizer(tmp, optimizer_of, reader)
        for f in hf_files:
            shutil.copy2(f, tmp / f.name)
        os.rename(tmp, out)
        owned.moved(out)
        owned.unmark()
    finally:
        owned.remove()  # every failure path, interrupts included; a no-op once renamed into place
    return out


class _DCPSource:
    """One model entry of a DCP checkpoint (See [Note: DCP's layout] in _dcp.py), streamed chunk by
    chunk in flat order: memory holds one saved chunk (one saving rank's part of the tensor)."""

    def __init__(self, dcp: DCPCheckpoint, key: str):
        self.dcp, self.entry, self.key, self.kind, self.name = dcp, dcp.model_prefix + key, key, "dcp", key
        self.shape, self.dtype = list(dcp.size(self.entry)), dcp.dtype(self.entry)
        self.numel = math.prod(self.shape)
        self.pieces = sorted(dcp.pieces(self.entry, 0, self.numel), key=lambda p: p.at)  # checks the cover

    def chunks(self):
        step = max(1, CHUNK_BYTES // torch.empty((), dtype=self.dtype).element_size())
        for piece in self.pieces:
            got: list[torch.Tensor] = []
            self.dcp.read([piece], lambda p, t: got.append(t))
            flat = got[0]
            for a in range(0, flat.numel(), step):
                yield flat[a:a + step]


def _dcp_sources(ckpt: Path) -> list[_DCPSource]:
    """The model entries of a DCP checkpoint: under ``model.`` (or ``app.model.``) where there is
    one, else the top level's tensors that are not a torchtitan run's other state."""
    dcp = DCPCheckpoint(ckpt)
    keys = dcp.model_keys()
    if not keys:
        raise CheckpointError(f"{ckpt} is a DCP checkpoint without model tensors (its first entries: "
                              f"{sorted(dcp.entries)[:8]})")
    return [_DCPSource(dcp, key) for key in keys]


def _memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def _check_memory(sources: list[_Source], dtype) -> None:
    """See [Note: a lying checkpoint cannot grow memory]."""
    seen, need = set(), 0
    for src in sources:
        if (src.kind, src.name) not in seen:
            seen.add((src.kind, src.name))
            need += src.numel * torch.empty((), dtype=_out_dtype(src, dtype)).element_size()
    available = _memory_available()
    if available is not None and need > available:
        raise CheckpointError(f"format 'torch' needs the whole model in memory ({need / 2**30:.2f} GiB) but "
                              f"{available / 2**30:.2f} GiB are available; use the streamed safetensors format")


def _hf_files(hf_config) -> list[Path]:
    path = Path(hf_config)
    folder = path.parent if path.name == "config.json" else path
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"hf_config {hf_config}: no config.json there")
    return [folder / n for n in HF_FILES if (folder / n).is_file()]


def _stream_into(writer: StreamWriter, src: _Source, dtype: torch.dtype) -> None:
    for piece in src.chunks():
        writer.write(src.key, piece.to(dtype))


def _write_safetensors(tmp: Path, sources: list[_Source], dtype, limit: int | None) -> None:
    sizes = [src.numel * torch.empty((), dtype=_out_dtype(src, dtype)).element_size() for src in sources]
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if limit is not None and shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    names = ["model.safetensors"] if limit is None else \
        [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map = {}
    for name, members in zip(names, shards):
        specs = [(sources[i].key, _out_dtype(sources[i], dtype), sources[i].shape) for i in members]
        with StreamWriter(tmp / name, specs, {"format": "pt"}) as w:
            for i in members:
                _stream_into(w, sources[i], _out_dtype(sources[i], dtype))
            w.close()
        weight_map.update({sources[i].key: name for i in members})
    if limit is not None:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_torch(tmp: Path, sources: list[_Source], dtype) -> None:
    """Whole state dict in memory (torch.save cannot stream); tied names share one tensor."""
    full: dict[str, torch.Tensor] = {}
    done: dict[tuple[str, str], torch.Tensor] = {}
    for src in sources:
        ident = (src.kind, src.name)
        if ident not in done:
            out_dtype = _out_dtype(src, dtype)
            t = torch.empty(src.numel, dtype=out_dtype)
            at = 0
            for piece in src.chunks():
                t[at:at + piece.numel()].copy_(piece)
                at += piece.numel()
            done[ident] = t.view(src.shape)
        full[src.key] = done[ident]
    torch.save(full, tmp / "pytorch_model.bin")


def _write_optimizer(tmp: Path, meta: Metadata, reader) -> None:
    """optimizer.safetensors: ``<fqn>.<key>`` for each parameter's state, full shape; scalars 0-d."""
    sources: list[_Source] = []
    scalars: list[tuple[str, torch.Tensor]] = []
    for fqn, p in meta.params.items():
        group = meta.groups[p.group]
        for key in group.state_tensors:
            sources.append(_Source(f"{fqn}.{key}", "param", fqn, meta, reader,
                                   lambda g, key=key: g.state_tensor(key)))
            sources[-1].dtype = dtype_from_name(group.state_tensors[key])
        for key, sc in group.state_scalars.items():
            if sc["tensor"]:
                scalars.append((f"{fqn}.{key}", torch.tensor(sc["value"], dtype=dtype_from_name(sc["dtype"]))))
    for fqn, entry in (meta.experts or {}).get("state", {}).items():  # expert parallelism's, fused again
        for key, dt in entry["tensors"].items():
            sources.append(_ExpertSource(f"{fqn}.{key}", fqn, meta, reader, f".state.{key}", dtype_from_name(dt)))
        for key, sc in entry["scalars"].items():
            if sc["tensor"]:
                scalars.append((f"{fqn}.{key}", torch.tensor(sc["value"], dtype=dtype_from_name(sc["dtype"]))))
    specs = [(s.key, s.dtype, s.shape) for s in sources] + [(k, t.dtype, list(t.shape)) for k, t in scalars]
    info = {"format": "pt", "optimizer": json.dumps(meta.optimizer), "loss_scaler": json.dumps(meta.loss_scaler)}
    with StreamWriter(tmp / "optimizer.safetensors", specs, info) as w:
        for s in sources:
            _stream_into(w, s, s.dtype)
        for k, t in scalars:
            w.write(k, t)
        w.close()
