"""Load a DCP checkpoint of an FSDP2/torchtitan run into a set-up model and its optimizer.

The same two phases as every load (See [Note: verify, agree, then copy] in _load.py):
:func:`check_dcp` compares the checkpoint with the model (names, shapes, buffers), the saved
optimizer state and hyperparameters with the running optimizer, and reads every chunk this
rank's copy will read once, checking it, before any rank copies; :class:`DCPLoad` then only
copies, group by group, each rank reading the chunks that overlap its own shard (See [Note:
DCP's layout] in _dcp.py).

What moves: each parameter's fp32 value into the master (or the frozen shard), every
elementwise state entry (Adam's ``exp_avg``, ``exp_avg_sq``; any tensor of the parameter's
shape) into the group's flat state, scalar state (``step``) once per flat group (all of a
group's parameters must agree, as they do after any run of whole steps), buffers, and the
param groups' hyperparameters. DCP records no optimizer class: the saved param groups' fields
must be fields of the running optimizer (Adam's ``betas`` are not SGD's), and decoupled weight
decay (AdamW) must match.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ._dcp import DCP_METADATA, DCPCheckpoint, Piece, is_dcp_checkpoint
from ._layout import CheckpointError
from ._load import PreparedLoad, _hyperparameter_updates, _refuse_or_warn_unmatched, _step_tensor, register_format

# param-group fields that say how the optimizer runs, not what it computes: the running optimizer keeps its own
_IMPLEMENTATION_FIELDS = frozenset({"foreach", "fused", "capturable", "differentiable", "params",
                                    "decoupled_weight_decay"})


class DCPLoad(PreparedLoad):
    """A DCP checkpoint's load, every check passed: copies each group's element ranges out of the
    chunks that hold them. Each group comes in whole (not streamed as our own format's are)."""

    streams_groups = False

    def _copy(self) -> None:
        dcp: DCPCheckpoint = self.reader
        for g in self.engine.groups:
            with g.resident(write_back=True):  # NVMe-swapped state comes in, and goes back loaded
                state = _group_state(dcp, g, self.zopts, self.names)
                _read_into(dcp, _group_jobs(dcp, g, self.names, state))
                if state is not None:
                    zopt = self.zopts[g.optimizer_index]
                    zopt.optimizer.state[g.master] = state
                    # the rebuilt state tensors rest where the master does from now on (NVMe: the swap file)
                    g.masters.track_optimizer_state(state, replace=True)
        sd = self.model.state_dict(keep_vars=True)
        for key in self.buffers:
            t = sd[key].data
            jobs = [(p, t.view(-1)) for p in dcp.pieces(dcp.model_entry([key]), 0, t.numel())]
            _read_into(dcp, jobs)


def _group_state(dcp: DCPCheckpoint, g, zopts, names) -> dict | None:
    """The optimizer state of running group ``g``, its elementwise tensors zero (filled by the
    group's reads); None where none is loaded (no optimizer, frozen, or saved before a first step)."""
    if not (zopts and g.trainable):
        return None
    zopts[g.optimizer_index].optimizer.state.pop(g.master, None)
    saved = dcp.group_state.get(id(g))
    if saved is None:
        return None
    elementwise, scalars = saved
    state: dict[str, Any] = {}
    optimizer = zopts[g.optimizer_index].optimizer
    for key, value in scalars.items():
        state[key] = _step_tensor(optimizer, g.master, value) if key == "step" else value
    for key in elementwise:
        state[key] = torch.zeros(g.shard_numel, dtype=g.master.dtype, device=g.master.device)
    return state


def _group_jobs(dcp: DCPCheckpoint, g, names, state: dict | None,
                check: bool = False) -> list[tuple[Piece, torch.Tensor | None]]:
    """(piece, destination) for everything of group ``g`` this rank keeps: weights, and the
    elementwise entries of ``state`` (None: weights only). ``check``: the pieces alone, no destination."""
    jobs = []
    target = None if check else g.weight_shard
    elementwise = dcp.group_state.get(id(g), ((), {}))[0] if state is not None else ()
    for s, lo, hi, where in g.slot_ranges_in_shard():
        key = dcp.model_entry(names[id(s.param)])
        if key is None:
            continue  # missing: allowed by strict=False, keeps its current value
        jobs += [(p, None if check else target[where]) for p in dcp.pieces(key, lo, hi)]
        saved = dcp.state_of(names[id(s.param)])
        for k in elementwise:
            dst = None if check else state[k][where]
            jobs += [(p, dst) for p in dcp.pieces(saved[k], lo, hi)]
    return jobs


def _read_into(dcp: DCPCheckpoint, jobs: list[tuple[Piece, torch.Tensor | None]]) -> None:
    """Copy each piece into its destination (None: read it, to check it, and drop it)."""
    dsts = {id(p): dst for p, dst in jobs}

    def sink(p: Piece, t: torch.Tensor) -> None:
        dst = dsts[id(p)]
        if dst is not None:
            dst[p.at:p.at + p.b - p.a].copy_(t)

    dcp.read([p for p, _ in jobs], sink)


def prepare_dcp(ckpt_dir, names, buffers: list[str], model, engine, zopts, strict: bool) -> tuple:
    """(reader, buffers to load, hyperparameter updates, extra state, the load's class) of a DCP
    directory, every check passed (See [Note: other systems' formats] in _load.py)."""
    dcp = DCPCheckpoint(ckpt_dir, {n for ns in names.values() for n in ns} | set(buffers))
    buffers, hyper = check_dcp(dcp, names, buffers, model, engine, zopts, strict)
    return dcp, buffers, hyper, None, DCPLoad


def check_dcp(dcp: DCPCheckpoint, names, buffers: list[str], model, engine, zopts,
              strict: bool) -> tuple[list[str], list]:
    """Everything a DCP load checks before the copy; returns (buffers to load, hyperparameter updates)."""
    mismatched, missing, ours = [], [], set(buffers)
    for g in engine.groups:
        for s in g.slots:
            ours.update(names[id(s.param)])
            key = dcp.model_entry(names[id(s.param)])
            if key is None:
                missing.append(s.fqn)
            elif dcp.size(key) != tuple(s.shape):
                mismatched.append(f"{s.fqn}: checkpoint {dcp.size(key)}, model {tuple(s.shape)}")
    if mismatched:
        raise CheckpointError(f"{dcp.dir}: parameter shapes differ: {mismatched}")
    missing += [k for k in buffers if dcp.model_entry([k]) is None]
    unexpected = sorted(k for k in dcp.model_keys() if k not in ours)
    _refuse_or_warn_unmatched(dcp.dir, sorted(missing), unexpected, strict)
    buffers = [k for k in buffers if dcp.model_entry([k]) is not None]
    sd = model.state_dict(keep_vars=True)
    for key in buffers:
        if dcp.size(dcp.model_entry([key])) != tuple(sd[key].shape):
            raise CheckpointError(f"buffer {key}: checkpoint shape {dcp.size(dcp.model_entry([key]))}, "
                                  f"model {tuple(sd[key].shape)}")
    dcp.group_state = _saved_group_states(dcp, names, engine, zopts) if zopts else {}
    # every chunk this rank's copy reads, read once now: a missing, truncated or hostile file refuses the load
    jobs = [job for g in engine.groups for job in _group_jobs(dcp, g, names, _checking(dcp, g, zopts), check=True)]
    jobs += [(p, None) for k in buffers for p in dcp.pieces(dcp.model_entry([k]), 0, sd[k].numel())]
    _read_into(dcp, jobs)
    if not zopts:
        return buffers, []
    return buffers, [(_hyperparameters(dcp, names, engine, zopts[0]), None)]


def _checking(dcp: DCPCheckpoint, g, zopts) -> dict | None:
    if not (zopts and g.trainable) or dcp.group_state.get(id(g)) is None:
        return None
    return {k: None for k in dcp.group_state[id(g)][0]}


def _saved_group_states(dcp: DCPCheckpoint, names, engine, zopts) -> dict[int, tuple | None]:
    """Per trainable running group: (elementwise state keys, {scalar key: value}) from the saved
    per-parameter state, or None when its parameters have none (saved before their first step)."""
    if len(zopts) != 1:
        raise CheckpointError(f"{dcp.dir} holds the state of one optimizer, but {len(zopts)} were given")
    dcp.refuse_unnamed_state()
    if dcp.optim_prefix is None:
        raise CheckpointError(f"{dcp.dir} holds no optimizer state (no '<prefix>.state.<parameter>.<key>' entries); "
                              "pass optimizer=None to load the model weights only (the optimizer then starts fresh)")
    out: dict[int, tuple | None] = {}
    for g in engine.groups:
        if not g.trainable:
            continue
        if g.owned:
            raise CheckpointError(
                f"{g.name}: the optimizer keeps whole parameters per rank here (the ownership layout, for optimizers "
                "that are not elementwise), which a DCP checkpoint's state is not read into: resume with an "
                "elementwise optimizer (Adam, AdamW, SGD), or load the weights alone (optimizer=None)")
        # a parameter the checkpoint lacks altogether (strict=False) starts from zero state, as in our format
        present = [s for s in g.slots if dcp.model_entry(names[id(s.param)]) is not None]
        saved = {s.fqn: dcp.state_of(names[id(s.param)]) for s in present}
        if not any(saved.values()):
            out[id(g)] = None
            continue
        lacking = sorted(fqn for fqn, st in saved.items() if not st)
        if lacking:
            raise CheckpointError(f"{dcp.dir} holds optimizer state for some parameters of {g.name} but not for "
                                  f"{lacking}: they were frozen or not stepped in the saved run (load with "
                                  "optimizer=None, or freeze them again)")
        elementwise, scalar_keys = _split_state(dcp, g, saved)
        values = dcp.read_values([st[k] for st in saved.values() for k in scalar_keys])
        scalars: dict[str, Any] = {}
        for k in scalar_keys:
            found = {_plain(values[st[k]]) for st in saved.values()}
            if len(found) != 1:
                raise CheckpointError(f"{dcp.dir}: the parameters of {g.name} were saved with different {k} values "
                                      f"{sorted(found, key=str)}; they share one optimizer state here")
            scalars[k] = found.pop()
        out[id(g)] = (elementwise, scalars)
    return out


def _split_state(dcp: DCPCheckpoint, g, saved: dict[str, dict[str, str]]) -> tuple[tuple[str, ...], list[str]]:
    """The state keys of group ``g``'s parameters, as (elementwise, scalar); all parameters must have
    the same, each elementwise one of its parameter's shape."""
    shapes = {s.fqn: tuple(s.shape) for s in g.slots}
    first = next(iter(saved))
    keys = set(saved[first])
    elementwise, scalars = set(), set()
    for fqn, st in saved.items():
        if set(st) != keys:
            raise CheckpointError(f"{dcp.dir}: {fqn} was saved with optimizer state {sorted(st)} but {first} with "
                                  f"{sorted(keys)}; they share one optimizer state here")
        for k, entry in st.items():
            if dcp.is_tensor(entry) and dcp.size(entry) == shapes[fqn]:
                elementwise.add(k)
            elif not dcp.is_tensor(entry) or dcp.size(entry) == ():
                scalars.add(k)
            else:
                raise CheckpointError(f"{dcp.dir}: optimizer state {entry} has shape {dcp.size(entry)}, neither its "
                                      f"parameter's {shapes[fqn]} nor a scalar")
    if elementwise & scalars:
        raise CheckpointError(f"{dcp.dir}: optimizer state {sorted(elementwise & scalars)} is a scalar for some "
                              f"parameters of {g.name} and a tensor for others")
    return tuple(sorted(elementwise)), sorted(scalars)


def _plain(value: Any) -> Any:
    """A saved scalar as a hashable Python value (a 0-d tensor as its number)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, list):
        return tuple(value)
    return value


def _saved_param_groups(dcp: DCPCheckpoint) -> dict[str, tuple[Any, dict]]:
    """fqn -> (identity of its saved param group, that group's fields), from either form of
    ``param_groups`` (See [Note: DCP's layout] in _dcp.py)."""
    prefix = f"{dcp.optim_prefix}param_groups."
    values = dcp.read_values(dcp.group_keys)
    nested: dict[str, dict] = {}
    flat: dict[str, dict] = {}
    for key, value in values.items():
        head, _, field = key[len(prefix):].rpartition(".")
        (nested if re.fullmatch(r"\d+", head) else flat).setdefault(head, {})[field] = value
    out: dict[str, tuple[Any, dict]] = {}
    for j, fields in nested.items():
        params = fields.pop("params", None)
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, str) for p in params):
            raise CheckpointError(f"{dcp.dir}: {prefix}{j}.params is not a list of parameter names")
        for p in params:
            out[p] = (int(j), fields)
    for fqn, fields in flat.items():
        out[fqn] = (tuple(sorted((k, str(v)) for k, v in fields.items())), fields)
    return out


def _hyperparameters(dcp: DCPCheckpoint, names, engine, zopt) -> list:
    """Each running param group's saved hyperparameters, checked to fit the running optimizer."""
    saved_of = _saved_param_groups(dcp)
    opt = zopt.optimizer
    per_group: list[dict] = [{} for _ in opt.param_groups]
    seen: list[dict] = [{} for _ in opt.param_groups]   # identity -> a parameter saved in it
    for g in engine.groups:
        if not g.trainable:
            continue
        for s in g.slots:
            found = next((saved_of[n] for n in names[id(s.param)] if n in saved_of), None)
            if found is None:
                continue
            ident, fields = found
            j = g.optimizer_group
            seen[j].setdefault(ident, s.fqn)
            if len(seen[j]) > 1:
                a, b = list(seen[j].values())[:2]
                raise CheckpointError(f"{dcp.dir}: {a} and {b} are in optimizer param group {j} here but were in "
                                      "different param groups in the saved run")
            per_group[j] = fields
    where = dcp.dir / DCP_METADATA
    for j, fields in enumerate(per_group):
        running = opt.param_groups[j]
        alien = sorted(set(fields) - set(running) - {"initial_lr"})
        if alien:
            raise CheckpointError(
                f"{dcp.dir}: param group {j} was saved with fields {alien} that the running {type(opt).__name__} does "
                "not have: it was saved by another optimizer; resume with the optimizer it was saved with")
        was, here = fields.get("decoupled_weight_decay"), running.get("decoupled_weight_decay")
        if was is not None and here is not None and bool(was) != bool(here) and fields.get("weight_decay"):
            raise CheckpointError(
                f"{dcp.dir}: param group {j} was stepped with {'decoupled (AdamW)' if was else 'L2 (Adam)'} weight "
                f"decay, but the optimizer is {type(opt).__name__} with {'decoupled' if here else 'L2'} weight decay: "
                f"resume it with torch.optim.{'AdamW' if was else 'Adam'}")
    saved = {"param_groups": [{k: _as_saved(v) for k, v in fields.items()} for fields in per_group]}
    return _hyperparameter_updates(saved, zopt, where, 0, skip=_IMPLEMENTATION_FIELDS | {"initial_lr"})


def _as_saved(value: Any) -> Any:
    """A hyperparameter as our own metadata would hold it: tuples as lists, 0-d tensors as numbers."""
    if isinstance(value, tuple):
        return [_as_saved(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


register_format(is_dcp_checkpoint, prepare_dcp)
