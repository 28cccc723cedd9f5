"""The metadata file: written with its checksum, read back only after validation.

Apart from ``_layout.py`` (the dataclasses: what a checkpoint holds) and
``_validate.py`` (the checks), because writing and reading need both: the
checksum (``digest``) and the checks live with the validation, the types with the
layout, and this module joins them without either importing the other.
See [Note: the metadata is input, not truth] in _validate.py.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ._layout import (FORMAT_NAME, METADATA_FILE, READABLE_VERSIONS, CheckpointError, FileRecord,
                      GroupLayout, Metadata, ParamLayout)
from ._validate import check_checksum, check_metadata, check_raw, digest


def metadata_json(meta: Metadata) -> str:
    """``meta`` as the JSON text of the metadata file, its checksum filled in."""
    d = asdict(meta)
    if d["experts"] is None:  # a checkpoint without expert parallelism stays readable by earlier versions
        del d["experts"]
    d["checksum"] = digest(d)
    return json.dumps(d, indent=1, sort_keys=False)


def parse_metadata(d: dict, where: str, path: Path | None = None) -> Metadata:
    """Parse and validate (``path``: the metadata file, named in errors)."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{where} is not a zero_strategy checkpoint (its metadata is not a mapping)")
    if d.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{where} is not a zero_strategy checkpoint (format {d.get('format')!r})")
    if d.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{where}: unknown checkpoint format version {d.get('version')!r}; this zero_strategy "
            f"reads versions {', '.join(map(str, READABLE_VERSIONS))} (upgrade zero_strategy to read newer "
            "checkpoints)")
    path = path if path is not None else Path(where) / METADATA_FILE
    check_raw(d, path)
    d = dict(d)
    d["groups"] = [GroupLayout(**g) for g in d["groups"]]
    d["params"] = {k: ParamLayout(**p) for k, p in d["params"].items()}
    d["files"] = [FileRecord(**_file_entry(f)) for f in d["files"]]
    meta = Metadata(**d)
    check_metadata(meta, path)
    return meta


def _file_entry(f: dict) -> dict:
    """A version-1 entry's bare sha256 hex as the digest it is (checked by check_raw and check_metadata)."""
    if "sha256" not in f:
        return f
    f = dict(f)
    f["digest"] = f"sha256:{f.pop('sha256')}" if isinstance(f["sha256"], str) else f.pop("sha256")
    return f


def read_metadata(ckpt_dir: Path) -> Metadata:
    """The validated metadata of the checkpoint directory ``ckpt_dir``."""
    path = ckpt_dir / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} is not a zero_strategy checkpoint: it has no {METADATA_FILE} "
                              "(an interrupted save never leaves one); nor is it a DeepSpeed checkpoint (no 'latest' "
                              "file, no *_optim_states.pt), nor a torch.distributed.checkpoint directory (no .metadata)")
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # ValueError: bad JSON or UTF-8
        raise CheckpointError(f"{path} is unreadable or corrupted: {err}") from None
    if isinstance(d, dict) and d.get("format") == FORMAT_NAME and d.get("version") in READABLE_VERSIONS:
        check_checksum(d, path)
    return parse_metadata(d, str(ckpt_dir), path)
