"""The checkpoint every tampering test damages, and the table of damages with their messages.

Each case edits a copy of one intact checkpoint: ``meta(d)`` edits the parsed
metadata.json (re-signed with a fresh checksum unless ``sign=False``, so the
validation behind the checksum is what must refuse it), ``files(dir)`` damages files
on disk (updating their recorded digest and size, so the header checks are what must
refuse it). ``load`` is the message ``load_checkpoint`` must raise, ``consolidate``
the one ``consolidate`` must raise (None: not applicable, e.g. optimizer fields).
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import xxhash

import zero_strategy as zs
from zero_strategy.checkpoint._validate import digest
from _models import TinyLM, param_groups

RANK = "rank00000-of-00001.safetensors"


def tiny():
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    model.register_buffer("counts", torch.arange(4.0))
    return zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(stage=2))


def save_intact(path: Path) -> Path:
    model, opt = tiny()
    model(torch.randint(0, 37, (2, 8))).float().mean().backward()
    opt.step()
    zs.save_checkpoint(path, model, opt, extra_state={"tensor": torch.ones(2)})
    return path


def read_meta(d: Path) -> dict:
    return json.loads((d / "metadata.json").read_text())


def write_meta(d: Path, meta: dict, sign: bool = True) -> None:
    if sign:
        meta["checksum"] = digest(meta)
    (d / "metadata.json").write_text(json.dumps(meta))


def rewrite_file(d: Path, name: str, data: bytes) -> None:
    """Replace a file and record its new digest and size (a consistent, re-signed forgery)."""
    (d / name).write_bytes(data)
    meta = read_meta(d)
    rec = next(f for f in meta["files"] if f["name"] == name)
    rec["digest"], rec["bytes"] = "xxh3_128:" + xxhash.xxh3_128(data).hexdigest(), len(data)
    write_meta(d, meta)


def _header(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _pack(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _negative_offset(d: Path) -> None:
    header, body = _header((d / RANK).read_bytes())
    header["g0.frozen"]["data_offsets"][0] = -8
    rewrite_file(d, RANK, _pack(header, body))


def _extra_tensor(d: Path) -> None:
    header, body = _header((d / RANK).read_bytes())
    header["smuggled"] = {"dtype": "F32", "shape": [1], "data_offsets": [len(body), len(body) + 4]}
    rewrite_file(d, RANK, _pack(header, body + b"\0" * 4))


def _shape_lie_in_header(d: Path) -> None:
    header, body = _header((d / RANK).read_bytes())
    n = header["g0.frozen"]["shape"][0]
    header["g0.frozen"]["shape"] = [n // 2, 2] if n % 2 == 0 else [1, n]
    rewrite_file(d, RANK, _pack(header, body))


def _symlinked_rank_file(d: Path) -> None:
    target = d.parent / f"{d.name}-elsewhere.safetensors"
    shutil.move(d / RANK, target)
    (d / RANK).symlink_to(target)


def _param(meta: dict, name: str) -> dict:
    return meta["params"][name]


def _two_same_group(meta):
    """Two parameters of one group with the same numel (fc1 and fc2 weights of one block)."""
    a, b = _param(meta, "layers.0.fc1.weight"), _param(meta, "layers.0.fc2.weight")
    assert a["group"] == b["group"] and a["numel"] == b["numel"] and a["offset"] != b["offset"]
    return a, b


def _swap_offsets(meta):
    a, b = _two_same_group(meta)
    a["offset"], b["offset"] = b["offset"], a["offset"]


def _swap_names(meta):
    a, b = _two_same_group(meta)
    a["names"], b["names"] = b["names"], a["names"]


def _bump_offset(meta):
    p = _param(meta, "layers.0.fc1.weight")
    p["offset"] += 1


def _trainable_group(meta) -> dict:
    return next(g for g in meta["groups"] if g["trainable"] and g["state_tensors"])


def _set(path: str, value) -> Callable[[dict], None]:
    """An edit that sets one dotted path (list indices as integers) of the metadata."""
    def edit(meta):
        keys = path.split(".")
        obj = meta
        for k in keys[:-1]:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        last = keys[-1]
        if isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value
    return edit


@dataclass
class Case:
    id: str
    load: str
    consolidate: str | None = "same"
    meta: Callable[[dict], None] | None = None
    files: Callable[[Path], None] | None = None
    sign: bool = True

    def apply(self, intact: Path, target: Path) -> Path:
        shutil.copytree(intact, target)
        if self.meta is not None:
            meta = read_meta(target)
            self.meta(meta)
            write_meta(target, meta, sign=self.sign)
        if self.files is not None:
            self.files(target)
        return target

    @property
    def consolidate_message(self) -> str | None:
        return self.load if self.consolidate == "same" else self.consolidate


def _hyper(key: str, value) -> Callable[[dict], None]:
    """Set one hyperparameter of the first param group (``optimizer`` mirrors ``optimizers[0]``)."""
    def edit(meta):
        meta["optimizers"][0]["param_groups"][0][key] = value
        meta["optimizer"] = meta["optimizers"][0]
    return edit


CASES = [
    # the checksum: any edit by hand or by a tool that does not re-sign
    Case("edited_lr_unsigned", r"metadata\.json was modified after it was saved", sign=False,
         meta=_hyper("lr", 0.5)),
    Case("offsets_swapped_unsigned", r"metadata\.json was modified after it was saved", sign=False,
         meta=_swap_offsets),
    Case("checksum_removed", r"metadata\.json has no checksum", sign=False,
         meta=lambda m: m.pop("checksum")),
    # re-signed: the validation behind the checksum must refuse each
    Case("offset_digit_changed", r"params\['[a-z0-9._]+'\]: (elements from \d+ overlap 'layers\.0\.fc1\.weight'|"
         r"elements from \d+ overlap|elements \[\d+, \d+\) lie outside group)", meta=_bump_offset),
    Case("names_swapped", r"params\['layers\.0\.fc1\.weight'\]\.names: \['layers\.0\.fc2\.weight'\] does not "
         r"include the parameter's own name", meta=_swap_names),
    Case("shape_without_numel", r"params\['embed\.weight'\]: shape \[37, 25\] holds 925 elements but numel is "
         r"888", meta=lambda m: _param(m, "embed.weight").update(shape=[37, 25])),
    Case("huge_shape", r"params\['embed\.weight'\]: elements \[\d+, \d+\) lie outside group",
         meta=lambda m: _param(m, "embed.weight").update(shape=[10**6, 10**6], numel=10**12)),
    Case("negative_offset", r"params\['embed\.weight'\]\.offset: expected an integer in \[0, ",
         meta=lambda m: _param(m, "embed.weight").update(offset=-24)),
    Case("master_dtype_int8", r"groups\[\d+\]\.dtype: 'int8' is not the dtype of a master shard \(float32\)",
         meta=lambda m: _trainable_group(m).update(dtype="int8")),
    Case("state_dtype_changed", r"tensor 'g\d+\.state\.exp_avg' is float32 of shape \[\d+\] but metadata\.json "
         r"says float16", meta=lambda m: _trainable_group(m)["state_tensors"].update(exp_avg="float16")),
    Case("shard_numel_grown", r"groups\[0\]: padded_numel \d+ is not shard_numel \d+ x world_size 1",
         meta=_set("groups.0.shard_numel", 10**9)),
    Case("group_grown_consistently", r"tensor 'g0\.frozen' is float32 of shape \[\d+\] but metadata\.json says "
         r"float32 of shape \[1000000000\]", meta=lambda m: m["groups"][0].update(
             numel=10**9, padded_numel=10**9, shard_numel=10**9)),
    Case("stage_out_of_range", r"stage: expected an integer in \[0, 3\], got 7", meta=_set("stage", 7)),
    Case("unknown_top_level_key", r"top level: unknown key\(s\) \['surprise'\]", meta=_set("surprise", 1)),
    Case("group_key_missing", r"groups\[0\]: missing key\(s\) \['numel'\]",
         meta=lambda m: m["groups"][0].pop("numel")),
    Case("duplicate_state_dict_key", r"state_dict_keys\[1\]: key '[a-z_.]+' is listed twice",
         meta=lambda m: m["state_dict_keys"].insert(1, list(m["state_dict_keys"][0]))),
    Case("lr_nan", r"optimizers\[0\]\.param_groups\[0\]\.lr: nan is not a finite number",
         meta=_hyper("lr", float("nan"))),
    Case("lr_infinite", r"optimizers\[0\]\.param_groups\[0\]\.lr: inf is not a finite number",
         meta=_hyper("lr", float("inf"))),
    Case("params_in_param_group", r"optimizers\[0\]\.param_groups\[0\]: holds 'params': a checkpoint never "
         r"restores the optimizer's parameter list", meta=_hyper("params", [1])),
    Case("lr_of_another_type", r"optimizers\[0\]\.param_groups\[0\]\.lr: saved value 'fast' does not fit",
         consolidate=None, meta=_hyper("lr", "fast")),
    Case("betas_wrong_length", r"optimizers\[0\]\.param_groups\[0\]\.betas: saved value \[0\.9\] does not fit",
         consolidate=None, meta=_hyper("betas", [0.9])),
    Case("step_nan", r"state_scalars\['step'\]: value nan is not a finite number",
         meta=lambda m: _trainable_group(m)["state_scalars"]["step"].update(value=float("nan"))),
    Case("loss_scale_negative", r"loss_scalers\[0\]\.scale: -1\.0 is not a finite positive scale",
         meta=lambda m: m.update(loss_scalers=[{"scale": -1.0, "good_steps": 0, "hysteresis_left": 1}])),
    # path escapes: names in metadata are fixed basenames inside the checkpoint
    Case("file_name_traversal", r"files\[\d\]\.name: '\.\./\.\./x' is not a file this checkpoint format writes",
         meta=lambda m: m["files"][-1].update(name="../../x")),
    Case("file_name_absolute", r"files\[\d\]\.name: '/etc/hostname' is not a file this checkpoint format writes",
         meta=lambda m: m["files"][-1].update(name="/etc/hostname")),
    Case("extra_state_traversal", r"extra_state\.file: '\.\./outside\.pt' is not 'extra_state\.pt'",
         meta=lambda m: m["extra_state"].update(file="../outside.pt")),
    Case("file_listed_twice", r"files\[\d\]\.name: 'rank00000-of-00001\.safetensors' is listed twice",
         meta=lambda m: m["files"].append(dict(m["files"][0]))),
    Case("rank_file_unlisted", r"files: does not list \['rank00000-of-00001\.safetensors'\]",
         meta=lambda m: m["files"].pop(0)),
    Case("world_size_changed", r"groups\[0\]\.world_size: 1, but the checkpoint's world_size is 2",
         meta=_set("world_size", 2)),
    # file damage with a matching (re-recorded) digest: the header checks must refuse it
    Case("header_negative_offset", rf"{RANK} is not a valid safetensors file", files=_negative_offset),
    Case("header_extra_tensor", rf"{RANK} holds tensor 'smuggled', which metadata\.json does not describe",
         files=_extra_tensor),
    Case("header_shape_lie", rf"{RANK}: tensor 'g0\.frozen' is float32 of shape \[\d+, \d+\] but metadata\.json",
         files=_shape_lie_in_header),
    Case("rank_file_symlink", rf"{RANK} is a symbolic link; checkpoint files are plain files",
         files=_symlinked_rank_file),
    Case("metadata_not_utf8", r"metadata\.json is unreadable or corrupted",
         files=lambda d: (d / "metadata.json").write_bytes(b"\xff\xfe{" + b"\x00" * 10)),
    Case("metadata_truncated", r"metadata\.json is unreadable or corrupted",
         files=lambda d: (d / "metadata.json").write_bytes((d / "metadata.json").read_bytes()[:200])),
]
