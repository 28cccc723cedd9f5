"""A DeepSpeed checkpoint loaded into a set-up model: the checks of prepare and the copy of commit
(See [Note: verify, agree, then copy] in _load.py), over the reader of DeepSpeed's files
(_deepspeed.py, or _deepspeed_universal.py for a universal checkpoint).

It is another system's format, as DCP is (_dcp_load.py): it builds on ``PreparedLoad`` and the
checks of _load.py and registers itself with ``load_checkpoint`` when the package imports it
(See [Note: other systems' formats] in _load.py), so _load.py holds only our own format's load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ._deepspeed import DeepSpeedCheckpoint, find_deepspeed_checkpoint
from ._deepspeed_universal import UniversalCheckpoint, is_universal
from ._layout import CheckpointError
from ._load import PreparedLoad, _hyperparameter_updates, _refuse_or_warn_unmatched, _step_tensor, register_format

# DeepSpeed's param-group fields that say how the optimizer runs, not what it computes: the running
# optimizer keeps its own
_DEEPSPEED_IMPLEMENTATION_FIELDS = frozenset({"foreach", "fused", "capturable", "differentiable", "step"})


class DeepSpeedLoad(PreparedLoad):
    """A DeepSpeed checkpoint's load, every check passed (See [Note: DeepSpeed's layout] in _deepspeed.py):
    the same phases as our own format's, copying out of DeepSpeed's memory-mapped rank files. Each
    group comes in whole (not yet streamed as our format's are)."""

    streams_groups = False

    def _copy(self) -> None:
        ds: DeepSpeedCheckpoint = self.reader
        for g in self.engine.groups:
            with g.resident(write_back=True):  # NVMe-swapped state comes in, and goes back loaded
                _load_deepspeed_group(ds, g, self.zopts, self.names)
        sd = self.model.state_dict(keep_vars=True)
        for key in self.buffers:
            sd[key].data.copy_(ds.buffer(key))


def _load_deepspeed_group(ds: DeepSpeedCheckpoint, g, zopts, names) -> None:
    target = g.weight_shard
    sources = []
    for s, lo, hi, where in g.slot_ranges_in_shard():
        name = ds.name_of(names[id(s.param)])
        if name is None:
            continue  # missing: allowed by strict=False, keeps its current value
        sources.append((name, lo, hi, where))
        if name in ds.params:
            ds.fill(target[where], name, lo, hi, None)
        else:
            ds.fill_frozen(target[where], name, lo, hi)
    if not (zopts and g.trainable):
        return
    zopt = zopts[g.optimizer_index]
    zopt.optimizer.state.pop(g.master, None)
    step = _deepspeed_step(ds, g, names)
    if step is None:
        return  # saved before the first step
    state: dict[str, Any] = {"step": _step_tensor(zopt.optimizer, g.master, step)}
    for key in ds.state_keys:
        t = torch.zeros(g.shard_numel, dtype=torch.float32, device=g.master.device)
        for name, lo, hi, where in sources:
            ds.fill(t[where], name, lo, hi, key)
        state[key] = t
    zopt.optimizer.state[g.master] = state
    # the rebuilt state tensors rest where the master does from now on (NVMe: the swap file)
    g.masters.track_optimizer_state(state, replace=True)


def _deepspeed_step(ds: DeepSpeedCheckpoint, g, names) -> float | None:
    """The one step count DeepSpeed saved for the trainable parameters of running group ``g``."""
    steps = {ds.steps[ds.params[n].flat] for n in (ds.name_of(names[id(s.param)]) for s in g.slots)
             if n is not None and n in ds.params}
    if len(steps) > 1:
        raise CheckpointError(f"{ds.dir}: the parameters of {g.name} were saved at different step counts "
                              f"{sorted(steps, key=str)}")
    return steps.pop() if steps else None


def _check_deepspeed(ds: DeepSpeedCheckpoint, names, buffers: list[str], model, engine, zopts,
                     strict: bool) -> tuple[list[str], list]:
    """Everything a DeepSpeed load checks before the copy; returns (buffers to load, hyperparameter updates)."""
    missing, mismatched, used = [], [], set()
    for g in engine.groups:
        for s in g.slots:
            name = ds.name_of(names[id(s.param)])
            if name is None:
                missing.append(s.fqn)
                continue
            used.add(name)
            if tuple(ds.shape_of(name)) != tuple(s.shape):
                mismatched.append(f"{s.fqn}: checkpoint {tuple(ds.shape_of(name))}, model {tuple(s.shape)}")
            elif zopts and g.trainable and name not in ds.params:
                raise _frozen_in_checkpoint(s.fqn)
            elif zopts and g.trainable and ds.params[name].param_group != g.optimizer_group:
                raise CheckpointError(f"{s.fqn} is in optimizer param group {g.optimizer_group} here but was in "
                                      f"param group {ds.params[name].param_group} in the DeepSpeed run")
        if zopts and g.trainable:
            _deepspeed_step(ds, g, names)
    if mismatched:
        raise CheckpointError(f"{ds.dir}: parameter shapes differ: {mismatched}")
    saved_buffers = set(ds.buffer_names)
    missing += [k for k in buffers if k not in saved_buffers]
    unexpected = sorted((set(ds.params) | set(ds.frozen)) - used) + sorted(saved_buffers - set(buffers))
    _refuse_or_warn_unmatched(ds.dir, sorted(missing), unexpected, strict)
    buffers = [k for k in buffers if k in saved_buffers]
    sd = model.state_dict(keep_vars=True)
    for key in buffers:
        saved = ds.buffer(key)
        if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(sd[key].shape):
            got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise CheckpointError(f"buffer {key}: checkpoint shape {got}, model {tuple(sd[key].shape)}")
    ds.load_frozen_files()
    if not zopts:
        return buffers, []
    scaler = zopts[0].scaler  # See [Note: DeepSpeed's loss scale, carried over] in _deepspeed.py
    scale = ds.loss_scale_state(scaler.state_dict(), scaler.cfg.growth_interval) if scaler.enabled else None
    return buffers, [(_deepspeed_hyperparameters(ds, zopts, engine), scale)]


def _deepspeed_hyperparameters(ds: DeepSpeedCheckpoint, zopts, engine) -> list:
    """The checks of the optimizer a DeepSpeed run's state goes into; its hyperparameter updates."""
    if len(zopts) != 1:
        raise CheckpointError(f"{ds.dir} holds the state of one optimizer, but {len(zopts)} were given")
    zopt = zopts[0]
    if any(g.owned for g in engine.groups if g.trainable):
        raise _layout_changed("the model", "flat shards (DeepSpeed)", "whole parameters (the ownership layout)")
    opt = zopt.optimizer
    if ds.state_keys and not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        raise CheckpointError(f"{ds.dir} holds Adam state {ds.state_keys}, but the optimizer is "
                              f"{type(opt).__name__}: resume it with torch.optim.AdamW or Adam")
    expected = set(_ADAM_TENSORS) | ({"max_exp_avg_sq"} if any(pg.get("amsgrad") for pg in ds.param_groups) else set())
    if ds.state_keys and set(ds.state_keys) != expected:
        raise CheckpointError(f"{ds.dir} holds optimizer state {ds.state_keys}; Adam state {sorted(expected)} is read")
    if len(ds.param_groups) != len(opt.param_groups):
        raise CheckpointError(f"{ds.dir} has {len(ds.param_groups)} optimizer param groups, the optimizer "
                              f"{len(opt.param_groups)}")
    for j, saved in enumerate(ds.param_groups):
        if saved.get("bias_correction") is False:
            raise CheckpointError(f"{ds.dir}: param group {j} was stepped without Adam's bias correction "
                                  "(bias_correction: false), which torch's Adam always applies")
        was = _saved_decoupled(ds, saved)
        here = bool(opt.param_groups[j].get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)))
        if was is not None and was != here and "decoupled_weight_decay" not in saved and saved.get("weight_decay"):
            raise CheckpointError(
                f"{ds.dir}: param group {j} was stepped with {'decoupled (AdamW)' if was else 'L2 (Adam)'} weight "
                f"decay, but the optimizer is {type(opt).__name__} with {'decoupled' if here else 'L2'} weight decay: "
                f"resume it with torch.optim.{'AdamW' if was else 'Adam'}")
    saved = {"param_groups": [{k: list(v) if isinstance(v, tuple) else v for k, v in pg.items()}
                              for pg in ds.param_groups]}
    skip = _DEEPSPEED_IMPLEMENTATION_FIELDS | {"params", "adam_w_mode", "bias_correction"}
    return _hyperparameter_updates(saved, zopt, ds.optim_files[0], 0, skip=skip)


_ADAM_TENSORS = ("exp_avg", "exp_avg_sq")


def _saved_decoupled(ds: DeepSpeedCheckpoint, saved: dict) -> bool | None:
    """Whether the DeepSpeed run's Adam decayed weights decoupled (AdamW); None where nothing says.

    torch's Adam/AdamW as the client optimizer record it in the param group (restored with the other
    fields); FusedAdam records ``adam_w_mode``; DeepSpeedCPUAdam nothing, so it comes from the
    config's optimizer section as DeepSpeed reads it (engine.py: type AdamW, or ``adam_w_mode``,
    default true)."""
    if "decoupled_weight_decay" in saved:
        return bool(saved["decoupled_weight_decay"])
    if "adam_w_mode" in saved:
        return bool(saved["adam_w_mode"])
    section = ds.config.get("optimizer") or {}
    kind, params = str(section.get("type", "")).lower(), section.get("params") or {}
    if kind in ("adam", "adamw"):
        return kind == "adamw" or bool(params.get("adam_w_mode", True))
    return None


def is_deepspeed_checkpoint(ckpt_dir: Path) -> bool:
    return find_deepspeed_checkpoint(ckpt_dir) is not None


def prepare_deepspeed(ckpt_dir: Path, names, buffers: list[str], model, engine, zopts, strict: bool) -> tuple:
    """(reader, buffers to load, hyperparameter updates, extra state, the load's class) of a DeepSpeed
    checkpoint directory, every check passed (See [Note: DeepSpeed's layout] in _deepspeed.py)."""
    tag_dir = find_deepspeed_checkpoint(ckpt_dir)
    reader = UniversalCheckpoint(tag_dir) if is_universal(tag_dir) else DeepSpeedCheckpoint(tag_dir)
    buffers, hyper = _check_deepspeed(reader, names, buffers, model, engine, zopts, strict)
    return reader, buffers, hyper, reader.client_state(), DeepSpeedLoad


register_format(is_deepspeed_checkpoint, prepare_deepspeed)
