"""Read a PyTorch Distributed Checkpoint (DCP) directory of an FSDP2 or torchtitan run, piece by piece.

[Note: DCP's layout]
``dcp.save(state_dict, checkpoint_id=dir)`` writes ``dir/.metadata`` and one or more
``__<rank>_<n>.distcp`` files. The state dict is flattened first: nested dicts become dotted
keys, so ``{"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opt)}``
gives::

    model.<fqn>                          a tensor (FSDP2: a DTensor, one chunk per rank)
    optim.state.<fqn>.<key>              exp_avg, exp_avg_sq (the parameter's shape), step (0-d)
    optim.param_groups.<j>.<field>       lr, betas, ... and ``params`` (the group's fqns): pickled values

torchtitan keeps the model's entries at the top level (``<fqn>``), its optimizer under
``optimizer.`` in the flattened form of ``get_optimizer_state_dict(...,
StateDictOptions(flatten_optimizer_state_dict=True))``: ``optimizer.state.<fqn>.<key>`` and
``optimizer.param_groups.<fqn>.<field>``; the PyTorch recipe's ``AppState`` nests both under
``app.``. So nothing is assumed about the prefixes: they are found from the model's own names
(:class:`DCPCheckpoint` looks each entry's dotted suffixes up among them). What is not read
is refused by name: optimizer state keyed by parameter index (a raw ``optimizer.state_dict()``),
the state of several optimizers, and tensors cut into chunks that are not contiguous in
row-major order (sharded on a dimension other than the first, as tensor parallelism does).

``.metadata`` lists every tensor's global size and its chunks (offsets and sizes, one per
saving rank for FSDP2's Shard(0)), and where each chunk's bytes lie (file, offset, length);
each chunk is one ``torch.save``d tensor there, and each non-tensor value one ``torch.save``d
object. A chunk that is contiguous in row-major order holds the flat elements
[start, start + numel) of its tensor, so the element range [lo, hi) of a parameter that a rank
of ours keeps (See [Note: re-sharding by name] in _load.py) is the union of its overlaps with
the chunks: a rank reads exactly the chunks that overlap its own shard, one at a time, through
DCP's own ``FileSystemReader`` (which also undoes any storage transform the writer applied).

[Note: unpickling DCP's files]
``.metadata`` is a pickle, and ``FileSystemReader.read_metadata`` unpickles it with
``pickle.load``; non-tensor values are read by DCP's default planner with
``torch.load(weights_only=False)``: either can run code from the file. Here ``.metadata`` goes
through an unpickler that builds only DCP's own metadata records, ``torch.Size``, dtypes,
layouts and paths, and every value through ``torch.load(weights_only=True)``; tensors DCP
already reads with ``weights_only=True``. Anything else refuses the load, naming the file and
the type (SECURITY.md).
"""

from __future__ import annotations

import io
import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ._layout import CheckpointError

DCP_METADATA = ".metadata"
#: entries of a torchtitan checkpoint that are neither the model nor the optimizer
_TORCHTITAN_STATES = ("train_state", "dataloader", "lr_scheduler")


def is_dcp_checkpoint(path: Path) -> bool:
    return (path / DCP_METADATA).is_file()


# ------------------------------------------------------------------ unpickling
_METADATA_TYPES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else. See [Note: unpickling DCP's files]."""

    def find_class(self, module: str, name: str):
        if name in _METADATA_TYPES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                        torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def _refused(path: Path, what: str, err: Exception) -> CheckpointError:
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    if found:
        return CheckpointError(
            f"{path} holds a pickled object of type {found.group(1)} ({what}), which is not one of the types a "
            "DCP checkpoint of model and optimizer state holds: refused (DCP's pickles are read with an allowlist; "
            "an unknown type could run code when unpickled)")
    return CheckpointError(f"{path}: {what} is unreadable: {type(err).__name__}: {str(err)[:300]}")


def read_dcp_metadata(ckpt_dir: Path):
    """``.metadata`` of a DCP directory, unpickled with the allowlist and checked for what is read."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    path = ckpt_dir / DCP_METADATA
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except OSError as err:
        raise CheckpointError(f"{path} is unreadable: {err}") from None
    except Exception as err:  # noqa: BLE001 - unpickling fails in many types
        raise _refused(path, "the checkpoint's metadata", err) from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{path} is not the metadata of a torch.distributed.checkpoint directory")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{path}: entry {key!r} is neither a tensor nor a value")
        if isinstance(entry, TensorStorageMetadata):
            for c in entry.chunks:
                if len(c.offsets) != len(entry.size) or len(c.sizes) != len(entry.size) or \
                        any(o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, entry.size)):
                    raise CheckpointError(f"{path}: a chunk of {key} at {tuple(c.offsets)} of size {tuple(c.sizes)} "
                                          f"lies outside its size {tuple(entry.size)}")
    for index, info in md.storage_data.items():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) \
                or not re.fullmatch(r"[\w.\-]+", info.relative_path) or info.relative_path.startswith(".") \
                or not isinstance(info.offset, int) or not isinstance(info.length, int) \
                or info.offset < 0 or info.length < 0:
            raise CheckpointError(f"{path}: the storage record of {getattr(index, 'fqn', index)!r} is not a file "
                                  "name, offset and length inside the checkpoint directory")
    return md


def load_value(data: io.BytesIO, where: str) -> Any:
    """A value DCP ``torch.save``d, read with ``weights_only=True``. See [Note: unpickling DCP's files]."""
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - pickle refusals come in several types
        raise _refused(Path(where), "a saved value", err) from None


# ------------------------------------------------------------------ chunks
def contiguous_start(shape, offsets, sizes) -> int | None:
    """The flat start of a chunk that is contiguous in row-major order; None if it is not.

    Contiguous: ones, then one partial dimension, then whole dimensions (``(1, 1, k, D3, D4)``)."""
    k = next((i for i, s in enumerate(sizes) if s != 1), len(sizes))
    if any(s != n for s, n in zip(sizes[k + 1:], shape[k + 1:])):
        return None
    start, stride = 0, 1
    for o, n in zip(reversed(offsets), reversed(shape)):
        start += o * stride
        stride *= n
    return start


def flat_boxes(shape, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, sizes) of the contiguous boxes that tile the flat elements [lo, hi) of ``shape``."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    first, last = lo // row, (hi - 1) // row
    inner = len(shape) - 1

    def within(r: int, a: int, b: int):
        return [((r,) + o, (1,) + s) for o, s in flat_boxes(shape[1:], a, b)]

    if first == last:
        return within(first, lo - first * row, hi - first * row)
    out = []
    if lo > first * row:
        out += within(first, lo - first * row, row)
        first += 1
    end = last + 1 if hi == (last + 1) * row else last
    if end > first:
        out.append(((first,) + (0,) * inner, (end - first,) + shape[1:]))
    if end == last:
        out += within(last, 0, hi - last * row)
    return out


class _Reads:
    """A ``LoadPlanner`` for ``FileSystemReader.read_data``: each chunk lands in a fresh tensor handed
    to its sink, then dropped, so one chunk at a time is in memory."""

    def __init__(self, sinks: list[Callable[[Any], None]], dtypes: list[torch.dtype], where: str):
        self.sinks, self.dtypes, self.where = sinks, dtypes, where

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.sinks[read_item.dest_index.index](load_value(value, f"{self.where} ({read_item.dest_index.fqn})"))

    def resolve_tensor(self, read_item) -> torch.Tensor:
        return torch.empty(tuple(read_item.lengths), dtype=self.dtypes[read_item.dest_index.index])

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        self.sinks[read_item.dest_index.index](tensor)


@dataclass(frozen=True)
class Piece:
    """Elements [a, b) of a chunk's flat data, for elements [at, at + b - a) of the range asked for."""
    key: str
    chunk: Any
    a: int
    b: int
    at: int


class DCPCheckpoint:
    """A DCP directory: its metadata read (See [Note: unpickling DCP's files]) and its entries found
    for a model's names (See [Note: DCP's layout]). Tensors stay on disk until :meth:`read`."""

    def __init__(self, ckpt_dir: Path, model_names: set[str] | None = None):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.dir = ckpt_dir
        self.md = read_dcp_metadata(ckpt_dir)
        self.entries: dict[str, Any] = self.md.state_dict_metadata
        self.tensors = {k for k, v in self.entries.items() if isinstance(v, TensorStorageMetadata)}
        self.model_prefix = self._find_model_prefix(model_names) if model_names else self._guess_model_prefix()
        self._find_optimizer(model_names or set(self.model_keys()))
        #: per running flat group (by id): (elementwise state keys, scalar state) or None; set by check_dcp
        self.group_state: dict[int, tuple | None] = {}

    # -------------------------------------------------------------- finding the entries
    def _find_model_prefix(self, names: set[str]) -> str:
        """The prefix under which the model's names are entries: from the flattening's record
        (``planner_data``: entry -> its path in the saved nested dict, the last step the model's
        own name) where the planner kept one, else from the entries' dotted suffixes."""
        counts: dict[str, int] = {}
        paths = self.md.planner_data if isinstance(self.md.planner_data, dict) else {}
        for key in self.tensors:
            path = paths.get(key)
            if isinstance(path, tuple) and path and all(isinstance(p, (str, int)) for p in path):
                if path[-1] in names:
                    prefix = "".join(f"{p}." for p in path[:-1])
                    counts[prefix] = counts.get(prefix, 0) + 1
                continue
            for i in [0] + [m.end() for m in re.finditer(r"\.", key)]:
                if key[i:] in names:
                    counts[key[:i]] = counts.get(key[:i], 0) + 1
        if not counts:
            some = sorted(self.entries)[:8]
            raise CheckpointError(
                f"{self.dir} is a torch.distributed.checkpoint directory, but none of its tensors is one of the model's "
                f"parameters or buffers (its first entries: {some}): it holds another model, or a layout not read here "
                "(read: dcp.save({'model': model_state_dict, 'optim': optimizer_state_dict}) from "
                "torch.distributed.checkpoint.state_dict.get_state_dict, torchtitan's, or the same under one prefix)")
        return max(counts, key=lambda p: (counts[p], p in ("model.", "")))

    def _guess_model_prefix(self) -> str:
        """Without a model (consolidation): ``model.`` or ``app.model.`` where there is one, else the top level."""
        for prefix in ("model.", "app.model."):
            if any(k.startswith(prefix) for k in self.tensors):
                return prefix
        return ""

    def model_keys(self) -> list[str]:
        """The names of the model's entries (parameters and buffers), in the checkpoint's order."""
        p = self.model_prefix
        out = []
        for key in self.tensors:
            if not key.startswith(p) or re.search(r"(^|\.)(state|param_groups)\.", key[len(p):]):
                continue
            if p == "" and key.split(".", 1)[0] in _TORCHTITAN_STATES + ("optimizer", "optim"):
                continue
            out.append(key[len(p):])
        return out

    def _find_optimizer(self, names: set[str]) -> None:
        """The optimizer's prefix and per-parameter state; refuses the forms not read (See [Note: DCP's layout])."""
        state: dict[str, dict[str, str]] = {}     # fqn -> state key -> entry key
        prefixes, by_index = set(), []
        for key in self.entries:
            for m in re.finditer(r"(?:^|\.)state\.", key):
                fqn, _, sk = key[m.end():].rpartition(".")
                if fqn in names:
                    prefixes.add(key[:m.start() + (1 if m.start() else 0)])
                    state.setdefault(fqn, {})[sk] = key
                elif fqn.isdigit():
                    by_index.append(key)
        #: an entry of optimizer state keyed by parameter index, where no state is keyed by name (refused
        #: when the optimizer's state is to be loaded: :meth:`refuse_unnamed_state`)
        self.indexed = by_index[0] if by_index and not state else None
        if len(prefixes) > 1:
            raise CheckpointError(f"{self.dir} holds the state of several optimizers (under {sorted(prefixes)}); "
                                  "one is read")
        self.optim_prefix = prefixes.pop() if prefixes else None
        self.state = state
        groups = f"{self.optim_prefix or ''}param_groups."
        self.group_keys = [k for k in self.entries if k.startswith(groups)] if self.optim_prefix is not None else []

    def refuse_unnamed_state(self) -> None:
        if self.indexed is not None:
            raise CheckpointError(
                f"{self.dir} holds optimizer state keyed by parameter index ({self.indexed}): a raw "
                "optimizer.state_dict(), whose indices say nothing about which parameter is which. Save it with "
                "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict, which keys it by name (or load "
                "the weights alone: optimizer=None)")

    def model_entry(self, names: list[str]) -> str | None:
        """The entry of a parameter or buffer registered under ``names`` (tied: any of them)."""
        return next((self.model_prefix + n for n in names if self.model_prefix + n in self.tensors), None)

    def state_of(self, names: list[str]) -> dict[str, str]:
        """state key -> entry of the optimizer state saved for the parameter under ``names`` ({}: none)."""
        return next((self.state[n] for n in names if n in self.state), {})

    def size(self, key: str) -> tuple[int, ...]:
        return tuple(self.entries[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.entries[key].properties.dtype

    def is_tensor(self, key: str) -> bool:
        return key in self.tensors

    def close(self) -> None:
        """Nothing stays open between reads (each read opens and closes its files)."""

    # -------------------------------------------------------------- element ranges
    def pieces(self, key: str, lo: int, hi: int) -> list[Piece]:
        """The chunks of tensor ``key`` overlapping its flat elements [lo, hi), and where; refuses a
        range the chunks do not cover, or chunks that are not contiguous (See [Note: DCP's layout])."""
        entry = self.entries[key]
        shape, out, covered = tuple(entry.size), [], 0
        for c in entry.chunks:
            n = math.prod(c.sizes)
            if n == 0:
                continue
            start = contiguous_start(shape, tuple(c.offsets), tuple(c.sizes))
            if start is None:
                raise CheckpointError(
                    f"{self.dir}: {key} is saved in chunks of size {tuple(c.sizes)} of {shape}, cut along a dimension "
                    "other than the first (tensor parallelism?): only chunks contiguous in row-major order (FSDP2's "
                    "Shard(0), replicated tensors) are read")
            x0, x1 = max(lo, start), min(hi, start + n)
            if x0 < x1:
                out.append(Piece(key, c, x0 - start, x1 - start, x0 - lo))
                covered += x1 - x0
        if covered != hi - lo:
            raise CheckpointError(f"{self.dir}: the chunks of {key} cover {covered} of its elements [{lo}, {hi}): "
                                  "the checkpoint is incomplete or its chunks overlap")
        return out

    # -------------------------------------------------------------- reading
    def read(self, pieces: list[Piece], sink: Callable[[Piece, torch.Tensor], None]) -> None:
        """``sink(piece, flat elements [a, b) of its chunk)`` for each piece, file by file, one chunk in
        memory at a time (a chunk several pieces share is read once)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        chunks: dict[tuple, list[Piece]] = {}
        for p in pieces:
            chunks.setdefault((p.key, tuple(p.chunk.offsets)), []).append(p)
        requests = []
        for (key, offsets), ps in chunks.items():
            c = ps[0].chunk

            def consume(t: torch.Tensor, ps=ps) -> None:
                flat = t.reshape(-1)
                for p in ps:
                    sink(p, flat[p.a:p.b])

            requests.append((MetadataIndex(key, torch.Size(offsets)), tuple(c.sizes), self.dtype(key), consume))
        self._read(requests)

    def read_values(self, keys: list[str]) -> dict[str, Any]:
        """Each entry of ``keys`` whole: values as unpickled (allowlist), tensors as tensors (small ones only)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        out: dict[str, Any] = {}
        requests = []
        for key in keys:
            def keep(v, key=key):
                out[key] = v
            if key in self.tensors:
                chunks = self.entries[key].chunks
                if len(chunks) != 1 or tuple(chunks[0].sizes) != self.size(key):
                    raise CheckpointError(f"{self.dir}: {key} is saved in {len(chunks)} chunks; a whole value, "
                                          "one chunk, is read here")
                requests.append((MetadataIndex(key, torch.Size(chunks[0].offsets)), tuple(chunks[0].sizes),
                                 self.dtype(key), keep))
            else:
                requests.append((MetadataIndex(key), None, None, keep))
        self._read(requests)
        return out

    def _read(self, requests: list[tuple]) -> None:
        """Run DCP's ``FileSystemReader.read_data`` on (storage index, chunk sizes or None for a value,
        dtype, sink) requests, file by file (so a failure names its file)."""
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

        by_file: dict[str, list[ReadItem]] = {}
        sinks, dtypes = [], []
        for index, sizes, dtype, sink in requests:
            info = self.md.storage_data.get(index)
            if info is None:
                raise CheckpointError(f"{self.dir}/{DCP_METADATA} has no storage record for {index.fqn}"
                                      + (f" at {tuple(index.offset)}" if index.offset is not None else ""))
            path = self.dir / info.relative_path
            try:
                size = path.stat().st_size
            except OSError as err:
                raise CheckpointError(f"{path} (holding {index.fqn}) is missing or unreadable: {err}") from None
            if info.offset + info.length > size:
                raise CheckpointError(f"{path} is truncated: {index.fqn} lies at bytes [{info.offset}, "
                                      f"{info.offset + info.length}) of a {size}-byte file")
            dest = MetadataIndex(index.fqn, index.offset, len(sinks))
            sinks.append(sink)
            dtypes.append(dtype)
            if sizes is None:
                item = ReadItem(LoadItemType.BYTE_IO, dest, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))
            else:
                zeros = torch.Size([0] * len(sizes))
                item = ReadItem(LoadItemType.TENSOR, dest, zeros, index, zeros, torch.Size(sizes))
            by_file.setdefault(info.relative_path, []).append(item)
        reader = FileSystemReader(str(self.dir))
        reader.set_up_storage_reader(self.md, True)
        planner = _Reads(sinks, dtypes, str(self.dir))
        for name, items in by_file.items():
            try:
                reader.read_data(LoadPlan(items), planner).wait()
            except CheckpointError:
                raise
            except Exception as err:  # noqa: BLE001 - torch.load and the file view fail in many types
                raise _refused(self.dir / name, "a saved tensor", err) from None
