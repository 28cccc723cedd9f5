"""Load a checkpoint into a set-up model on any world size and any stage.

[Note: re-sharding by name]
The running model's flat groups need not match the saved ones (other world size,
stage, persistence threshold or frozen set). For each running group, each rank
walks the slots intersecting its own shard, looks the parameter up by name in the
checkpoint layout, and reads just the elements it owns from the one or more saved
rank files that hold them (``safe_open(...).get_slice(name)[a:b]``): memory stays
at one shard, and no rank reads what it does not keep. Master shards, frozen
shards and elementwise optimizer state all move this way; scalar optimizer state
(``step``) and hyperparameters come from the metadata. Afterwards the compute-dtype
parameters are rebuilt from the masters exactly as after an optimizer step (copy
into the parameter shard, all-gather where parameters are replicated).

Every file a rank reads is first checked against the sha256 in the metadata. All
local work (checks, reads) happens before the first collective, and its errors are
agreed on across ranks, so a bad file raises on every rank instead of hanging some.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from .._engine.engine import refuse_while_offloaded
from .._model.gather import whole_model_pass
from ..api import engine_of
from ._layout import BUFFERS_FILE, CheckpointError, Metadata, dtype_from_name, resolve_zero_optimizers
from ._metadata_io import read_metadata
from ._safetensors_stream import verify_file
from ._sync import agree, describe
from ._validate import check_buffers_file, check_rank_file


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """``path``, or the previous checkpoint a save interrupted between its two renames left beside it."""
    path = Path(path).absolute()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file, not a zero_strategy checkpoint directory")
        return path
    olds = [p for p in old_checkpoints(path) if (p / "metadata.json").is_file()]
    if not olds:
        raise CheckpointError(f"no checkpoint at {path}")
    newest = max(olds, key=lambda p: (p / "metadata.json").stat().st_mtime)
    warnings.warn(f"{path} is missing but {newest.name} beside it is a complete checkpoint left by an "
                  "interrupted save; loading that one", stacklevel=3)
    return newest


def old_checkpoints(path: Path) -> list[Path]:
    """``<path>.old-<token>`` directories beside ``path`` (exact names, never a pattern over user names)."""
    pattern = re.compile(re.escape(path.name) + r"\.old-[0-9a-f]{12}")
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return []
    return [p for p in entries if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]


class _Reader:
    """Verified, lazily opened saved files; reads element ranges of their tensors."""

    def __init__(self, ckpt_dir: Path, meta: Metadata):
        self.dir, self.meta = ckpt_dir, meta
        self._open: dict[str, Any] = {}

    def handle(self, name: str):
        if name not in self._open:
            from safetensors import safe_open

            rec = self.meta.file(name)
            verify_file(self.dir / name, rec.sha256, rec.bytes)
            if name == BUFFERS_FILE:
                check_buffers_file(self.dir / name, self.meta)
            else:
                check_rank_file(self.dir / name, self.meta)
            try:
                self._open[name] = safe_open(str(self.dir / name), framework="pt")
            except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"checkpoint file {self.dir / name} is unreadable: {err}") from None
        return self._open[name]

    def fill(self, dst: torch.Tensor, fqn: str, lo: int, hi: int, tensor_of) -> None:
        """dst[0:hi-lo] <- elements [lo, hi) of parameter ``fqn``; ``tensor_of(group)`` names the tensor."""
        group = self.meta.groups[self.meta.params[fqn].group]
        for rank, a, b, at in self.meta.pieces(fqn, lo, hi):
            piece = self.handle(self.meta.rank_file(rank)).get_slice(tensor_of(group))[a:b]
            dst[at:at + b - a].copy_(piece)

    def tensor(self, rank: int, name: str) -> torch.Tensor:
        """The whole tensor ``name`` of rank file ``rank`` (per-parameter optimizer state)."""
        return self.handle(self.meta.rank_file(rank)).get_tensor(name)

    def close(self) -> None:
        self._open.clear()


@torch.no_grad()
def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer=None, strict: bool = True) -> Any:
    """Load a checkpoint saved by :func:`save_checkpoint` into a set-up model; return ``extra_state``.

    Works on any world size and stage. Every rank must call it. ``optimizer``: the one
    ``setup`` returned, to restore its state, hyperparameters and the loss scale (None:
    weights only). ``strict=False`` tolerates parameters or buffers missing on either
    side (with a warning) instead of raising.
    """
    engine = engine_of(model)
    refuse_while_offloaded(engine.offloaded, "zero_strategy.load_checkpoint()", ("optim_states", "hp_params", "lp_params"))
    with whole_model_pass(engine):  # See [Note: releases where a phase ends]
        return _load(path, model, engine, optimizer, strict)


def _load(path, model, engine, optimizer, strict: bool) -> Any:
    comm = engine.comm
    zopts = resolve_zero_optimizers(engine, optimizer)
    error, meta, extra, reader, hyper = None, None, None, None, []
    try:
        ckpt_dir = resolve_checkpoint_dir(path)
        meta = read_metadata(ckpt_dir)
        names, buffers = _model_names(model, engine)
        _check_compatible(meta, names, buffers, engine, zopts, strict, ckpt_dir)
        hyper = [_hyperparameter_updates(saved, zopt, ckpt_dir, i)
                 for i, (zopt, saved) in enumerate(zip(zopts, _saved_optimizers(meta)))]
        reader = _Reader(ckpt_dir, meta)
        _load_shards(reader, names, engine, zopts)
        _load_buffers(reader, model, buffers)
        extra = _extra_state(reader, meta)
    except Exception as err:  # noqa: BLE001 - agreed on below, raised on every rank
        error = f"cannot load checkpoint {path}: {describe(err)}"
    finally:
        if reader is not None:
            reader.close()
    agree(comm, error)
    _publish(engine)
    for zopt, updates, scaler in zip(zopts, hyper, _saved_scalers(meta)):
        _apply_hyperparameters(updates)
        if scaler is not None and zopt.scaler.enabled:
            zopt.scaler.load_state_dict(scaler)
    return extra


def _saved_optimizers(meta: Metadata) -> list:
    if meta.optimizers is not None:
        return meta.optimizers
    return [meta.optimizer] if meta.optimizer is not None else []


def _saved_scalers(meta: Metadata) -> list:
    if meta.loss_scalers is not None:
        return meta.loss_scalers
    return [meta.loss_scaler] * len(_saved_optimizers(meta))


# ------------------------------------------------------------------ checks
def _model_names(model, engine) -> tuple[dict[int, list[str]], list[str]]:
    from ._layout import param_names

    names = param_names(model)
    managed = engine.managed
    buffers = [k for k, t in model.state_dict(keep_vars=True).items() if id(t) not in managed]
    return {pid: n for pid, n in names.items() if pid in managed}, buffers


def _check_compatible(meta: Metadata, names, buffers, engine, zopts, strict: bool, ckpt_dir: Path) -> None:
    alias = meta.alias_map()
    model_keys = {n for ns in names.values() for n in ns} | set(buffers)
    ckpt_keys = set(alias) | set(meta.buffer_keys())
    missing, unexpected = sorted(model_keys - ckpt_keys), sorted(ckpt_keys - model_keys)
    mismatched = []
    for g in engine.groups:
        for s in g.slots:
            fqn = _fqn_in_checkpoint(alias, names[id(s.param)])
            if fqn is not None and list(meta.params[fqn].shape) != list(s.shape):
                mismatched.append(f"{s.fqn}: checkpoint {tuple(meta.params[fqn].shape)}, model {tuple(s.shape)}")
    if mismatched:
        raise CheckpointError(f"{ckpt_dir}: parameter shapes differ: {mismatched}")
    if missing or unexpected:
        msg = (f"{ckpt_dir} does not match the model: missing from the checkpoint: {missing or 'none'}; "
               f"in the checkpoint but not in the model: {unexpected or 'none'}")
        if strict:
            raise CheckpointError(msg + " (strict=False loads the rest)")
        warnings.warn(msg, stacklevel=4)
    if not zopts:
        return
    saved_all = _saved_optimizers(meta)
    if not saved_all:
        raise CheckpointError(f"{ckpt_dir} was saved without optimizer state; pass optimizer=None to load "
                              "the model weights only (the optimizer then starts fresh)")
    if len(saved_all) != len(zopts):
        raise CheckpointError(f"{ckpt_dir} holds the state of {len(saved_all)} optimizer(s), but "
                              f"{len(zopts)} were given")
    for zopt, saved_opt in zip(zopts, saved_all):
        have, saved = type(zopt.optimizer).__name__, saved_opt["class"]
        if have != saved:
            raise CheckpointError(f"{ckpt_dir} holds {saved} optimizer state but the optimizer is {have}")
        if len(saved_opt["param_groups"]) != len(zopt.optimizer.param_groups):
            raise CheckpointError(f"{ckpt_dir} has {len(saved_opt['param_groups'])} optimizer param groups, "
                                  f"the optimizer {len(zopt.optimizer.param_groups)}")


# ------------------------------------------------------------------ shards
def _fqn_in_checkpoint(alias: dict[str, str], names: list[str]) -> str | None:
    """The checkpoint's name for a parameter registered under ``names`` (None: not in it)."""
    return next((alias[n] for n in names if n in alias), None)


def _load_shards(reader: _Reader, names, engine, zopts) -> None:
    alias = reader.meta.alias_map()
    for g in engine.groups:
        with g.resident(write_back=True):  # NVMe-swapped state comes in, and goes back loaded
            _load_group(reader, g, zopts, names, alias)


def _load_group(reader: _Reader, g, zopts, names, alias) -> None:
    target = g.weight_shard
    for s, lo, hi, where in g.slot_ranges_in_shard():
        fqn = _fqn_in_checkpoint(alias, names[id(s.param)])
        if fqn is None:
            continue  # missing: allowed by strict=False, keeps its current value
        dst = target[where]
        reader.fill(dst, fqn, lo, hi, lambda grp: grp.weight_tensor)
    if zopts and g.trainable and g.owned:
        _load_param_state(reader, g, zopts[g.optimizer_index], names, alias)
        # the rebuilt per-parameter state rests where the master does (NVMe: See [Note: the
        # ownership layout on NVMe] in _optim/owned_runs.py)
        g.masters.track_optimizer_state(zopts[g.optimizer_index].swappable_state(g), replace=True)
    elif zopts and g.trainable:
        zopt = zopts[g.optimizer_index]
        _load_optimizer_state(reader, g, zopt, names, alias)
        # the rebuilt state tensors rest where the master does from now on (NVMe: the swap file)
        g.masters.track_optimizer_state(zopt.optimizer.state.get(g.master, {}), replace=True)


def _load_optimizer_state(reader: _Reader, g, zopt, names, alias) -> None:
    """Rebuild ``optimizer.state[master]`` for one running group from the saved groups of its slots."""
    meta = reader.meta
    sources = [(s, _fqn_in_checkpoint(alias, names[id(s.param)])) for s in g.slots]
    sources = [(s, fqn) for s, fqn in sources if fqn is not None]
    zopt.optimizer.state.pop(g.master, None)
    if not sources:
        return
    saved = [meta.groups[meta.params[fqn].group] for _, fqn in sources]
    first = saved[0]
    for grp, (s, fqn) in zip(saved, sources):
        if grp.param_state:
            raise _layout_changed(s.fqn, "whole parameters (the ownership layout)", "flat shards")
        if not grp.trainable:
            raise CheckpointError(f"{s.fqn} is trainable here but was frozen in the checkpoint: it has no "
                                  "optimizer state (load with optimizer=None, or freeze it again)")
        if grp.state_tensors != first.state_tensors or set(grp.state_scalars) != set(first.state_scalars):
            raise CheckpointError(f"{s.fqn} and {sources[0][0].fqn} share a group here but their saved "
                                  "optimizer state has different entries")
    if not first.state_tensors and not first.state_scalars:
        return  # saved before the first step
    state: dict[str, Any] = {}
    device = g.master.device
    for key, dname in first.state_tensors.items():
        t = torch.zeros(g.shard_numel, dtype=dtype_from_name(dname), device=device)
        for s, lo, hi, where in g.slot_ranges_in_shard():
            fqn = _fqn_in_checkpoint(alias, names[id(s.param)])
            if fqn is not None:
                dst = t[where]
                reader.fill(dst, fqn, lo, hi, lambda grp, key=key: grp.state_tensor(key))
        state[key] = t
    for key, sc in first.state_scalars.items():
        if sc["tensor"]:
            state[key] = torch.tensor(sc["value"], dtype=dtype_from_name(sc["dtype"]),
                                      device=device if sc["on_param_device"] else "cpu").reshape(sc["shape"])
        else:
            state[key] = sc["value"]
    zopt.optimizer.state[g.master] = state


def _layout_changed(fqn: str, saved: str, here: str) -> CheckpointError:
    return CheckpointError(
        f"{fqn}: its optimizer state was saved for {saved} but is kept here as {here}: the optimizer or "
        "ZeroConfig(optimizer_layout=...) changed since the save. Resume with the optimizer it was saved with, "
        "or load the weights alone (optimizer=None) and start the optimizer fresh")


def _load_param_state(reader: _Reader, g, zopt, names, alias) -> None:
    """Ownership layout: each parameter this rank owns now takes its whole saved state, from the rank
    file of whichever rank owned it then (See [Note: the on-disk layout] in _layout.py)."""
    meta = reader.meta
    for s, _, view in zopt.owned_views(g):
        zopt.optimizer.state.pop(view, None)
        fqn = _fqn_in_checkpoint(alias, names[id(s.param)])
        if fqn is None:
            continue
        grp = meta.groups[meta.params[fqn].group]
        if not grp.trainable:
            raise CheckpointError(f"{s.fqn} is trainable here but was frozen in the checkpoint: it has no "
                                  "optimizer state (load with optimizer=None, or freeze it again)")
        if grp.state_tensors or grp.state_scalars:
            raise _layout_changed(s.fqn, "flat shards", "whole parameters (the ownership layout)")
        entry = grp.param_state.get(fqn)
        if entry is None:
            continue  # saved before its first step
        state: dict[str, Any] = {}
        for key, t in entry["tensors"].items():
            value = reader.tensor(entry["rank"], grp.param_state_tensor(entry["slot"], key))
            state[key] = value.to(view.device if t["on_param_device"] else "cpu").reshape(t["shape"])
        for key, sc in entry["scalars"].items():
            state[key] = sc["value"]
        zopt.optimizer.state[view] = state


def _load_buffers(reader: _Reader, model, buffers: list[str]) -> None:
    saved = set(reader.meta.buffer_keys())
    sd = model.state_dict(keep_vars=True)
    todo = [k for k in buffers if k in saved]
    if not todo:
        return
    f = reader.handle(BUFFERS_FILE)
    for key in todo:
        value = f.get_tensor(key)
        target = sd[key]
        if tuple(value.shape) != tuple(target.shape):
            raise CheckpointError(f"buffer {key}: checkpoint shape {tuple(value.shape)}, model {tuple(target.shape)}")
        target.data.copy_(value)


def _extra_state(reader: _Reader, meta: Metadata) -> Any:
    extra = meta.extra_state
    if extra is None:
        return None
    if extra["kind"] == "json":
        return extra["value"]
    rec = meta.file(extra["file"])
    path = reader.dir / rec.name
    verify_file(path, rec.sha256, rec.bytes)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - pickle refusals come in several types
        raise CheckpointError(
            f"{path}: torch.load(weights_only=True) refused the saved extra_state ({err}); allow its types "
            "with torch.serialization.add_safe_globals([...]) before loading") from None


# ------------------------------------------------------------ after reading
def _publish(engine) -> None:
    """Compute-dtype parameters from the loaded shards, as after an optimizer step."""
    handles = []
    for g in engine.groups:
        with g.resident(write_back=True):  # NVMe: master in, updated parameter shard out
            handles.append(g.publish_master(engine.comm))
    for h in handles:
        if h is not None:
            h.wait()


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _hyperparameter_updates(saved_optimizer: dict, zopt, ckpt_dir: Path, index: int) -> list:
    """(param group, key, value) to restore: only fields the running optimizer has, with their types.

    Checked before anything is loaded, so a bad value refuses the whole load on every rank. A saved
    field the optimizer does not have is skipped with a warning; ``params`` is never restored.
    """
    updates, unknown = [], set()
    for j, (pg, saved) in enumerate(zip(zopt.optimizer.param_groups, saved_optimizer["param_groups"])):
        for key, value in saved.items():
            if key == "params" or key not in pg:
                unknown.add(key)
                continue
            current, at = pg[key], f"optimizers[{index}].param_groups[{j}].{key}"
            if isinstance(current, torch.Tensor):
                ok = _number(value) or isinstance(value, bool) and current.dtype == torch.bool
            elif isinstance(current, bool):
                ok = isinstance(value, bool)
            elif _number(current):
                ok = _number(value)
            elif isinstance(current, (tuple, list)):
                ok = (isinstance(value, list) and len(value) == len(current)
                      and all(_number(v) == _number(c) for v, c in zip(value, current)))
                value = tuple(value) if isinstance(current, tuple) and ok else value
            elif current is None:
                ok = value is None or isinstance(value, bool)
            else:
                ok = type(value) is type(current)
            if not ok:
                raise CheckpointError(f"{ckpt_dir / 'metadata.json'}: {at}: saved value {value!r} does not fit "
                                      f"the optimizer's {current!r} (a finite value of the same type is needed)")
            updates.append((pg, key, value))
    if unknown:
        warnings.warn(f"{ckpt_dir}: optimizer fields {sorted(unknown)} are not fields of the running "
                      f"{type(zopt.optimizer).__name__}; not restored", stacklevel=4)
    return updates


def _apply_hyperparameters(updates: list) -> None:
    for pg, key, value in updates:
        if isinstance(pg[key], torch.Tensor):
            pg[key].fill_(value)
        else:
            pg[key] = value


def load_metadata(path: str | Path) -> dict:
    """The metadata of a checkpoint as a plain dict (for tools and inspection), validated first."""
    ckpt_dir = resolve_checkpoint_dir(path)
    read_metadata(ckpt_dir)
    return json.loads((ckpt_dir / "metadata.json").read_text())
