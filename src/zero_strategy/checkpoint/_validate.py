"""Checks that make ``metadata.json`` trustworthy before a single tensor byte is read.

[Note: the metadata is input, not truth]
Everything a reader does is steered by the metadata: which file to open, which
element range of which tensor to copy where, which dtype to allocate, which
hyperparameters to put into the user's optimizer. A damaged or hand-edited file that
is still valid JSON must therefore never be followed blindly; a wrong offset or name
would load wrong weights *silently*. Three layers, each cheap next to reading the
tensors:

1. **Its own checksum.** ``checksum`` is the sha256 of the canonical JSON of every
   other key (sorted keys, no whitespace), so reformatting is harmless but any edited
   value is caught. It guards against damage and against edits by tools or people,
   not against a forger who recomputes it; layers 2 and 3 bound what such a forger
   can do to "wrong numbers in the right places", never reads outside the checkpoint,
   out-of-range slices, huge allocations or foreign optimizer fields.
2. **Self-consistency** (:func:`check_metadata`): every key known and typed; file
   names exactly the ones this format writes (plain basenames inside the checkpoint
   directory, so no path can escape it); each group's ``padded = shard × world``;
   every parameter's ``shape`` product equal to its ``numel``, its ``[offset, offset +
   numel)`` inside its group and not overlapping another parameter's; names unique;
   hyperparameters finite numbers, booleans, short strings or short lists of numbers.
3. **Agreement with the files** (:func:`check_rank_file`, :func:`check_buffers_file`):
   the header of each safetensors file, parsed by the ``safetensors`` library (which
   refuses negative, overlapping or out-of-file offsets and byte lengths that do not
   match shape × dtype), holds exactly the tensors the metadata implies, each with
   the dtype and ``[shard_numel]`` shape the metadata claims.

So a claimed element count is always backed by bytes that exist on disk, and the
memory a reader allocates is bounded by the checkpoint's real size.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from .._mechanisms.safetensors_writer import split_digest
from ._experts import expert_files, wanted_header
from ._layout import (BUFFERS_FILE, EXTRA_STATE_FILE, METADATA_FILE, CheckpointError, GroupLayout, Metadata,
                      rank_file_name)

_STATE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
#: dtypes a stored weight shard can have (fp32 masters; frozen shards in the compute dtype, or a
#: 4-bit base's packed codes in bitsandbytes' default uint8 storage: See [Note: opaque groups] in
#: _engine/flat.py)
_WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
_FROZEN_DTYPES = (*_WEIGHT_DTYPES, "uint8")
_STATE_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
_ST_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
             "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_MAX_WORLD = 1 << 20
_MAX_NUMEL = 1 << 48
_MAX_DIMS = 16
_MAX_HYPER_STR = 256
_MAX_HYPER_LIST = 16

_TOP_KEYS = {"world_size", "stage", "precision", "groups", "params", "state_dict_keys", "files", "optimizer",
             "loss_scaler", "optimizers", "loss_scalers", "extra_state", "experts", "format", "version",
             "zero_strategy_version", "checksum"}
_TOP_REQUIRED = {"world_size", "stage", "precision", "groups", "params", "state_dict_keys", "files", "format",
                 "version", "checksum"}
_GROUP_KEYS = {"index", "name", "trainable", "optimizer_group", "shard_params", "dtype", "numel", "padded_numel",
               "shard_numel", "world_size", "state_tensors", "state_scalars", "optimizer_index", "owned",
               "param_state"}
_PARAM_STATE_KEYS = {"rank", "slot", "tensors", "scalars"}
_PARAM_TENSOR_KEYS = {"dtype", "shape", "on_param_device"}
_PARAM_KEYS = {"fqn", "names", "shape", "group", "offset", "numel"}
#: a file entry's keys by format version: version 1 recorded a bare sha256 hex digest
_FILE_KEYS = {1: {"name", "sha256", "bytes", "rank"}, 2: {"name", "digest", "bytes", "rank"}}
_SCALER_KEYS = {"scale", "good_steps", "hysteresis_left"}


# ------------------------------------------------------------------ checksum
def digest(d: dict) -> str:
    """sha256 of the canonical JSON of ``d`` without its ``checksum`` key."""
    body = {k: v for k, v in d.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def check_checksum(d: dict, path: Path) -> None:
    recorded = d.get("checksum")
    if not isinstance(recorded, str):
        raise CheckpointError(f"{path} has no checksum: it was not written by this zero_strategy or the key "
                              "was removed; refusing to trust its layout")
    if recorded != digest(d):
        raise CheckpointError(f"{path} was modified after it was saved: its content does not match its "
                              "checksum; refusing to trust its layout (restore the file from the save)")


# ------------------------------------------------------------------ helpers
class _Where:
    """Names the file and entry in every message: ``<metadata.json>: <entry>: <problem>``."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, entry: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {entry}: {problem}")

    def keys(self, entry: str, d: Any, allowed: set, required: set) -> None:
        if not isinstance(d, dict):
            raise self.fail(entry, f"expected a mapping, got {type(d).__name__}")
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise self.fail(entry, f"unknown key(s) {unknown}")
        missing = sorted(required - set(d))
        if missing:
            raise self.fail(entry, f"missing key(s) {missing}")

    def int_(self, entry: str, v: Any, lo: int = 0, hi: int = _MAX_NUMEL) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise self.fail(entry, f"expected an integer in [{lo}, {hi}], got {v!r}")
        return v

    def type_(self, entry: str, v: Any, types: tuple, what: str) -> Any:
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool) and int in types):
            raise self.fail(entry, f"expected {what}, got {v!r}")
        return v


def _finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def hyperparameter_ok(v: Any) -> bool:
    """The values a torch optimizer's param group holds besides ``params``."""
    if v is None or isinstance(v, bool) or _finite_number(v):
        return True
    if isinstance(v, str):
        return len(v) <= _MAX_HYPER_STR
    if isinstance(v, list):
        return len(v) <= _MAX_HYPER_LIST and all(x is None or _finite_number(x) for x in v)  # Adafactor's eps
    return False


# ------------------------------------------------------------------ metadata
def check_raw(d: Any, path: Path) -> None:
    """Before building objects: the keys of every table, so a typo is a message, not a TypeError."""
    w = _Where(path)
    w.keys("top level", d, _TOP_KEYS, _TOP_REQUIRED)
    for name, kind in (("groups", list), ("params", dict), ("files", list), ("state_dict_keys", list)):
        if not isinstance(d[name], kind):
            raise w.fail(name, f"expected a {kind.__name__}, got {type(d[name]).__name__}")
    for i, g in enumerate(d["groups"]):
        w.keys(f"groups[{i}]", g, _GROUP_KEYS, _GROUP_KEYS - {"optimizer_index", "state_tensors", "state_scalars", "owned",
                                                           "param_state"})
    for fqn, p in d["params"].items():
        w.keys(f"params[{fqn!r}]", p, _PARAM_KEYS, _PARAM_KEYS)
    keys = _FILE_KEYS[d["version"]]
    for i, f in enumerate(d["files"]):
        w.keys(f"files[{i}]", f, keys, keys - {"rank"})


def check_metadata(meta: Metadata, path: Path) -> None:
    """Self-consistency of a parsed metadata (layer 2 of [Note: the metadata is input, not truth])."""
    w = _Where(path)
    ws = w.int_("world_size", meta.world_size, 1, _MAX_WORLD)
    w.int_("stage", meta.stage, 0, 3)
    w.type_("precision", meta.precision, (str,), "a string")
    for i, g in enumerate(meta.groups):
        _check_group(w, g, i, ws)
    _check_params(w, meta)
    _check_experts(w, meta)
    _check_files(w, meta)
    _check_state_dict_keys(w, meta)
    _check_optimizers(w, meta)


def _check_group(w: _Where, g: GroupLayout, i: int, ws: int) -> None:
    at = f"groups[{i}]"
    if g.index != i:
        raise w.fail(at, f"index {g.index!r} is not its position {i}")
    w.type_(f"{at}.name", g.name, (str,), "a string")
    w.type_(f"{at}.trainable", g.trainable, (bool,), "true or false")
    w.type_(f"{at}.shard_params", g.shard_params, (bool,), "true or false")
    if g.optimizer_group is not None:
        w.int_(f"{at}.optimizer_group", g.optimizer_group, 0, 1 << 16)
    if g.optimizer_index is not None:
        w.int_(f"{at}.optimizer_index", g.optimizer_index, 0, 1 << 16)
    if g.dtype not in _FROZEN_DTYPES or (g.trainable and g.dtype != "float32"):
        raise w.fail(f"{at}.dtype", f"{g.dtype!r} is not the dtype of a {'master' if g.trainable else 'frozen'} "
                     f"shard ({'float32' if g.trainable else ', '.join(_FROZEN_DTYPES)})")
    numel = w.int_(f"{at}.numel", g.numel)
    shard = w.int_(f"{at}.shard_numel", g.shard_numel)
    padded = w.int_(f"{at}.padded_numel", g.padded_numel, numel)
    if g.world_size != ws:
        raise w.fail(f"{at}.world_size", f"{g.world_size!r}, but the checkpoint's world_size is {ws}")
    if padded != shard * ws:
        raise w.fail(at, f"padded_numel {padded} is not shard_numel {shard} x world_size {ws} covering "
                     f"numel {numel}")
    if not isinstance(g.state_tensors, dict) or not isinstance(g.state_scalars, dict):
        raise w.fail(at, "state_tensors and state_scalars must be mappings")
    for key, dname in g.state_tensors.items():
        if not _STATE_KEY.fullmatch(str(key)) or dname not in _STATE_DTYPES:
            raise w.fail(f"{at}.state_tensors[{key!r}]", f"not an optimizer-state entry (key of letters, digits "
                         f"and _; dtype one of {', '.join(_STATE_DTYPES)}), got dtype {dname!r}")
    for key, sc in g.state_scalars.items():
        _check_scalar(w, f"{at}.state_scalars[{key!r}]", key, sc)
    w.type_(f"{at}.owned", g.owned, (bool,), "true or false")
    if not isinstance(g.param_state, dict) or (g.param_state and not g.owned):
        raise w.fail(f"{at}.param_state", "must be a mapping, and empty unless the group is owned")
    for fqn, entry in g.param_state.items():
        _check_param_state(w, f"{at}.param_state[{fqn!r}]", entry, ws, g.padded_numel)


def _check_param_state(w: _Where, at: str, entry: Any, ws: int, padded: int) -> None:
    """One parameter's optimizer state in the ownership layout (See [Note: the on-disk layout])."""
    w.keys(at, entry, _PARAM_STATE_KEYS, _PARAM_STATE_KEYS)
    w.int_(f"{at}.rank", entry["rank"], 0, ws - 1)
    w.int_(f"{at}.slot", entry["slot"], 0, padded)
    tensors, scalars = entry["tensors"], entry["scalars"]
    if not isinstance(tensors, dict) or not isinstance(scalars, dict):
        raise w.fail(at, "tensors and scalars must be mappings")
    for key, t in tensors.items():
        here = f"{at}.tensors[{key!r}]"
        w.keys(here, t, _PARAM_TENSOR_KEYS, _PARAM_TENSOR_KEYS)
        if not _STATE_KEY.fullmatch(str(key)) or t["dtype"] not in _STATE_DTYPES:
            raise w.fail(here, f"not an optimizer-state entry (key of letters, digits and _; dtype one of "
                         f"{', '.join(_STATE_DTYPES)}), got dtype {t['dtype']!r}")
        shape = t["shape"]
        if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
            raise w.fail(here, f"shape {shape!r} is not a list of at most {_MAX_DIMS} sizes")
        product = 1
        for x in shape:
            product *= w.int_(f"{here}.shape", x, 0, padded)
        if product > padded:
            raise w.fail(here, f"shape {shape} holds more elements than its group ({padded})")
        w.type_(f"{here}.on_param_device", t["on_param_device"], (bool,), "true or false")
    for key, sc in scalars.items():
        if not isinstance(sc, dict) or sc.get("tensor") is not False:
            raise w.fail(f"{at}.scalars[{key!r}]", f"not a non-tensor optimizer-state value: {sc!r}")
        _check_scalar(w, f"{at}.scalars[{key!r}]", key, sc)


def param_state_tensors(meta: Metadata, rank: int) -> dict[str, tuple[str, list[int]]]:
    """The per-parameter state tensors rank file ``rank`` holds: name -> (dtype, [numel])."""
    out = {}
    for g in meta.groups:
        for entry in g.param_state.values():
            if entry["rank"] == rank:
                for key, t in entry["tensors"].items():
                    out[g.param_state_tensor(entry["slot"], key)] = (t["dtype"], [math.prod(t["shape"])])
    return out


def _check_scalar(w: _Where, at: str, key: Any, sc: Any) -> None:
    if not _STATE_KEY.fullmatch(str(key)) or not isinstance(sc, dict) or not isinstance(sc.get("tensor"), bool):
        raise w.fail(at, f"not a scalar optimizer-state entry: {sc!r}")
    v = sc.get("value")
    if sc["tensor"]:
        w.keys(at, sc, {"value", "tensor", "dtype", "shape", "on_param_device"},
               {"value", "tensor", "dtype", "shape", "on_param_device"})
        if not (isinstance(v, bool) or _finite_number(v)):
            raise w.fail(at, f"value {v!r} is not a finite number")
        if sc["dtype"] not in _STATE_DTYPES:
            raise w.fail(at, f"dtype {sc['dtype']!r} is not one of {', '.join(_STATE_DTYPES)}")
        shape = sc["shape"]
        if not isinstance(shape, list) or len(shape) > _MAX_DIMS or any(x != 1 for x in shape):
            raise w.fail(at, f"shape {shape!r} is not the shape of one element")
        w.type_(at + ".on_param_device", sc["on_param_device"], (bool,), "true or false")
    else:
        w.keys(at, sc, {"value", "tensor"}, {"value", "tensor"})
        if not (v is None or isinstance(v, bool) or _finite_number(v)):
            raise w.fail(at, f"value {v!r} is not null, a boolean or a finite number")


def _check_params(w: _Where, meta: Metadata) -> None:
    seen: dict[str, str] = {}
    spans: dict[int, list[tuple[int, int, str]]] = {}
    for fqn, p in meta.params.items():
        at = f"params[{fqn!r}]"
        if p.fqn != fqn:
            raise w.fail(at, f"records fqn {p.fqn!r} under the key {fqn!r}")
        if not isinstance(p.names, list) or not p.names or not all(isinstance(n, str) and n for n in p.names):
            raise w.fail(f"{at}.names", f"expected a non-empty list of names, got {p.names!r}")
        if fqn not in p.names:
            raise w.fail(f"{at}.names", f"{p.names!r} does not include the parameter's own name {fqn!r}")
        for n in p.names:
            if n in seen:
                raise w.fail(f"{at}.names", f"name {n!r} is also recorded for {seen[n]!r}; names must be unique")
            seen[n] = fqn
        if not isinstance(p.shape, list) or len(p.shape) > _MAX_DIMS:
            raise w.fail(f"{at}.shape", f"expected a list of at most {_MAX_DIMS} sizes, got {p.shape!r}")
        product = 1
        for x in p.shape:
            product *= w.int_(f"{at}.shape", x)
        numel = w.int_(f"{at}.numel", p.numel)
        if product != numel:
            raise w.fail(at, f"shape {p.shape} holds {product} elements but numel is {numel}")
        if not meta.groups:
            raise w.fail(at, "refers to a group but the checkpoint has none")
        gi = w.int_(f"{at}.group", p.group, 0, len(meta.groups) - 1)
        offset = w.int_(f"{at}.offset", p.offset)
        group = meta.groups[gi]
        if offset + numel > group.padded_numel:  # the ownership layout pads between ranks' parameters
            raise w.fail(at, f"elements [{offset}, {offset + numel}) lie outside group {gi} "
                         f"({group.padded_numel} elements with padding)")
        spans.setdefault(gi, []).append((offset, offset + numel, fqn))
    for gi, items in spans.items():
        items.sort()
        for (a0, a1, fa), (b0, _, fb) in zip(items, items[1:]):
            if b0 < a1:
                raise w.fail(f"params[{fb!r}]", f"elements from {b0} overlap {fa!r} [{a0}, {a1}) in group {gi}")


def _check_experts(w: _Where, meta: Metadata) -> None:
    """The ``experts`` entry: sizes that divide, shapes, dtypes and state keys this format writes."""
    ex = meta.experts
    if ex is None:
        return
    w.keys("experts", ex, {"size", "params", "state"}, {"size", "params", "state"})
    size = w.int_("experts.size", ex["size"], 1, _MAX_WORLD)
    for part in ("params", "state"):
        if not isinstance(ex[part], dict):
            raise w.fail(f"experts.{part}", f"expected a mapping, got {type(ex[part]).__name__}")
    for fqn, desc in ex["params"].items():
        at = f"experts.params[{fqn!r}]"
        w.type_(at, fqn, (str,), "a parameter name")
        w.keys(at, desc, {"num_experts", "shape", "dtype"}, {"num_experts", "shape", "dtype"})
        n = w.int_(f"{at}.num_experts", desc["num_experts"], 1, 1 << 20)
        if n % size:
            raise w.fail(f"{at}.num_experts", f"{n} is not a multiple of experts.size {size}")
        shape = desc["shape"]
        if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
            raise w.fail(f"{at}.shape", f"expected a list of dimensions, got {shape!r}")
        for d in shape:
            w.int_(f"{at}.shape", d, 0, _MAX_NUMEL)
        if math.prod(shape) * n > _MAX_NUMEL:
            raise w.fail(f"{at}.shape", "too many elements")
        if desc["dtype"] not in _WEIGHT_DTYPES:
            raise w.fail(f"{at}.dtype", f"{desc['dtype']!r} is not one of {', '.join(_WEIGHT_DTYPES)}")
    for fqn, entry in ex["state"].items():
        at = f"experts.state[{fqn!r}]"
        if fqn not in ex["params"]:
            raise w.fail(at, "has no entry in experts.params")
        w.keys(at, entry, {"optimizer_index", "tensors", "scalars"}, {"optimizer_index", "tensors", "scalars"})
        w.int_(f"{at}.optimizer_index", entry["optimizer_index"], 0, 1 << 10)
        if not isinstance(entry["tensors"], dict) or not isinstance(entry["scalars"], dict):
            raise w.fail(at, "tensors and scalars must be mappings")
        for key, dt in entry["tensors"].items():
            if not _STATE_KEY.fullmatch(str(key)) or dt not in _STATE_DTYPES:
                raise w.fail(f"{at}.tensors", f"{key!r}: {dt!r} is not a state key and a dtype")
        for key, sc in entry["scalars"].items():
            _check_scalar(w, f"{at}.scalars[{key!r}]", key, sc)


def expected_files(meta: Metadata) -> dict[str, int | None]:
    """Every file name this format writes for ``meta``, with its rank (None: rank 0's extra files)."""
    names: dict[str, int | None] = {rank_file_name(r, meta.world_size): r for r in range(meta.world_size)}
    names[BUFFERS_FILE] = None
    if isinstance(meta.extra_state, dict) and meta.extra_state.get("kind") == "torch":
        names[EXTRA_STATE_FILE] = None
    if meta.experts is not None:
        names.update(expert_files(meta.experts))
    return names


def _check_files(w: _Where, meta: Metadata) -> None:
    extra = meta.extra_state
    if extra is not None:
        if not isinstance(extra, dict) or extra.get("kind") not in ("json", "torch"):
            raise w.fail("extra_state", f"expected {{'kind': 'json' | 'torch', ...}}, got {extra!r}")
        if extra["kind"] == "json":
            w.keys("extra_state", extra, {"kind", "value"}, {"kind", "value"})
        else:
            w.keys("extra_state", extra, {"kind", "file"}, {"kind", "file"})
            if extra["file"] != EXTRA_STATE_FILE:
                raise w.fail("extra_state.file", f"{extra['file']!r} is not {EXTRA_STATE_FILE!r}: file names in "
                             "a checkpoint are fixed basenames inside its directory")
    expected = expected_files(meta)
    seen = set()
    for i, f in enumerate(meta.files):
        at = f"files[{i}]"
        if not isinstance(f.name, str) or f.name not in expected:
            raise w.fail(f"{at}.name", f"{f.name!r} is not a file this checkpoint format writes (expected "
                         f"basenames inside the checkpoint directory: {sorted(expected)}); refusing to read it")
        if f.name in seen:
            raise w.fail(f"{at}.name", f"{f.name!r} is listed twice")
        seen.add(f.name)
        if f.rank != expected[f.name]:
            raise w.fail(f"{at}.rank", f"{f.rank!r}, but {f.name} belongs to rank {expected[f.name]}")
        try:  # See [Note: file digests] in _mechanisms/safetensors_writer.py
            split_digest(f.digest)
        except ValueError as err:
            raise w.fail(f"{at}.digest", f"{err}; refusing a file that cannot be verified") from None
        w.int_(f"{at}.bytes", f.bytes, 8, 1 << 50)
    missing = sorted(set(expected) - seen)
    if missing:
        raise w.fail("files", f"does not list {missing}, which a checkpoint of world size {meta.world_size} "
                     "must have")


def _check_state_dict_keys(w: _Where, meta: Metadata) -> None:
    seen = set()
    for i, entry in enumerate(meta.state_dict_keys):
        at = f"state_dict_keys[{i}]"
        if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(x, str) for x in entry)):
            raise w.fail(at, f"expected [key, 'param' | 'buffer', name], got {entry!r}")
        key, kind, name = entry
        if key in seen:
            raise w.fail(at, f"key {key!r} is listed twice")
        seen.add(key)
        if kind == "param":
            if name not in meta.params:
                raise w.fail(at, f"parameter {name!r} has no layout in params")
        elif kind == "expert":
            if meta.experts is None or name not in meta.experts["params"]:
                raise w.fail(at, f"experts {name!r} have no entry in experts.params")
        elif kind != "buffer" or name != key:
            raise w.fail(at, f"expected [key, 'param', fqn], [key, 'buffer', key] or [key, 'expert', fqn], "
                         f"got {entry!r}")


def _check_optimizers(w: _Where, meta: Metadata) -> None:
    opts = meta.optimizers
    if opts is None:
        opts = [meta.optimizer] if meta.optimizer is not None else []
    elif not isinstance(opts, list):
        raise w.fail("optimizers", f"expected a list, got {type(opts).__name__}")
    elif meta.optimizer is not None and (not opts or meta.optimizer != opts[0]):
        raise w.fail("optimizer", "differs from optimizers[0]")
    for i, opt in enumerate(opts):
        at = f"optimizers[{i}]"
        w.keys(at, opt, {"class", "module", "param_groups"}, {"class", "module", "param_groups"})
        w.type_(f"{at}.class", opt["class"], (str,), "a class name")
        w.type_(f"{at}.module", opt["module"], (str,), "a module name")
        if not isinstance(opt["param_groups"], list):
            raise w.fail(f"{at}.param_groups", "expected a list")
        for j, pg in enumerate(opt["param_groups"]):
            if not isinstance(pg, dict):
                raise w.fail(f"{at}.param_groups[{j}]", f"expected a mapping, got {pg!r}")
            for key, value in pg.items():
                if key == "params":
                    raise w.fail(f"{at}.param_groups[{j}]", "holds 'params': a checkpoint never restores the "
                                 "optimizer's parameter list")
                if not hyperparameter_ok(value):
                    raise w.fail(f"{at}.param_groups[{j}].{key}", f"{value!r} is not a finite number, a boolean, "
                                 "null, a short string or a short list of finite numbers or nulls")
    scalers = meta.loss_scalers
    if scalers is None:
        scalers = [meta.loss_scaler] * len(opts)
    if not isinstance(scalers, list) or len(scalers) != len(opts):
        raise w.fail("loss_scalers", f"expected one entry per optimizer ({len(opts)}), got {scalers!r}")
    for i, sc in enumerate(scalers):
        if sc is None:
            continue
        w.keys(f"loss_scalers[{i}]", sc, _SCALER_KEYS, _SCALER_KEYS)
        if not _finite_number(sc["scale"]) or sc["scale"] <= 0:
            raise w.fail(f"loss_scalers[{i}].scale", f"{sc['scale']!r} is not a finite positive scale")
        w.int_(f"loss_scalers[{i}].good_steps", sc["good_steps"], 0, 1 << 62)
        w.int_(f"loss_scalers[{i}].hysteresis_left", sc["hysteresis_left"], 0, 1 << 30)
    for g in meta.groups:
        if g.optimizer_index is not None and opts and g.optimizer_index >= len(opts):
            raise w.fail(f"groups[{g.index}].optimizer_index", f"{g.optimizer_index} but there are "
                         f"{len(opts)} optimizer(s)")


# ------------------------------------------------------------------ files
def header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype name, shape) of a safetensors file, parsed and validated by the safetensors library."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (_ST_NAMES.get(sl.get_dtype(), sl.get_dtype()), list(sl.get_shape()))
            return out
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"checkpoint file {path} is not a valid safetensors file: {err}") from None


def _compare(path: Path, have: dict, want: dict) -> None:
    for name in sorted(set(want) | set(have)):
        if name not in have:
            raise CheckpointError(f"checkpoint file {path} has no tensor {name!r}, which {METADATA_FILE} "
                                  "says it holds")
        if name not in want:
            raise CheckpointError(f"checkpoint file {path} holds tensor {name!r}, which {METADATA_FILE} does "
                                  "not describe")
        if have[name] != want[name]:
            raise CheckpointError(f"checkpoint file {path}: tensor {name!r} is {have[name][0]} of shape "
                                  f"{have[name][1]} but {METADATA_FILE} says {want[name][0]} of shape "
                                  f"{want[name][1]}")


def check_rank_file(path: Path, meta: Metadata) -> None:
    """The rank file holds exactly the group tensors the metadata describes, with their dtypes and shapes."""
    want = {}
    for g in meta.groups:
        want[g.weight_tensor] = (g.dtype, [g.shard_numel])
        for key, dname in g.state_tensors.items():
            want[g.state_tensor(key)] = (dname, [g.shard_numel])
    rank = next((r for r in range(meta.world_size) if meta.rank_file(r) == path.name), None)
    if rank is not None:
        want.update(param_state_tensors(meta, rank))
    _compare(path, header(path), want)


def check_experts_file(path: Path, meta: Metadata) -> None:
    """An experts file holds exactly the per-expert tensors ``experts`` describes (See [Note: experts in a
    checkpoint] in _experts.py)."""
    if meta.experts is None or path.name not in expert_files(meta.experts):
        raise CheckpointError(f"checkpoint file {path} is not an experts file {METADATA_FILE} describes")
    _compare(path, header(path), wanted_header(meta.experts, expert_files(meta.experts)[path.name]))


def check_buffers_file(path: Path, meta: Metadata) -> dict[str, tuple[str, list[int]]]:
    """The buffers file holds exactly the buffers of ``state_dict_keys``; returns its header."""
    have = header(path)
    want = set(meta.buffer_keys())
    for name in sorted(want ^ set(have)):
        where = "has no tensor" if name in want else "holds tensor"
        raise CheckpointError(f"checkpoint file {path} {where} {name!r}, which {METADATA_FILE} "
                              f"{'lists as a buffer' if name in want else 'does not list'}")
    return have
