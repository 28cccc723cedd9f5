"""Expert parallelism's rank-local experts in a sharded checkpoint: one tensor per expert, by global name.

[Note: experts in a checkpoint]
With ``expert_parallel_size=N`` each rank holds whole experts ``[i*E/N, (i+1)*E/N)`` of every
mixture-of-experts layer as rank-local parameters, outside the engine's flat groups, stepped by
a second optimizer instance (See [Note: expert parallelism] in _model/expert_parallel.py). A save
writes them beside the rank files, in the same directory and the same atomic commit: the ranks of
the first expert-parallel group (global ranks ``0 .. N-1``; the other groups are replicas of it)
each write ``experts<i>-of-<N>.safetensors`` holding, for every experts parameter ``fqn`` (the
model's own name, e.g. ``model.layers.0.mlp.experts.gate_up_proj``) and every expert ``e`` it
holds, ``<fqn>.<e>`` (the weight, one expert's ``[2I, H]`` or ``[H, I]``) and
``<fqn>.<e>.state.<key>`` for every elementwise optimizer-state tensor (Adam's moments, of the
expert's shape). Scalar state (Adam's ``step``, the same for every expert) and the per-expert
shapes and dtypes go into the metadata's ``experts`` entry, which the checksum covers and
_validate.py checks; each file is hashed and its header checked against it before a load reads
a byte, like every other file.

Because every expert is stored whole under its global index, a load at another world size or
another ``expert_parallel_size`` takes, on each rank, the rows of the experts it holds now from
whichever files hold them. A model set up without expert parallelism (the experts in the engine's
flat groups) takes the weights of such a checkpoint, each rank the rows of its shards (the
optimizer state is refused by name: pass ``optimizer=None``); an expert-parallel model cannot take
a checkpoint saved without it yet (refused by name).

The offline tools read the same files in one process: ``consolidate`` and ``export_checkpoint`` (DCP,
DeepSpeed universal) rebuild each fused ``[E, ...]`` parameter, and its elementwise optimizer state,
from the per-expert tensors laid end to end in expert order (:func:`expert_pieces`), under the model's
own name, so their output is what a run without expert parallelism writes.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from ._layout import CheckpointError, dtype_from_name, dtype_name, param_names

#: the names of the expert parameters a fused experts module holds
_NAMES = ("gate_up_proj", "down_proj")


def experts_file_name(index: int, size: int) -> str:
    return f"experts{index:05d}-of-{size:05d}.safetensors"


def expert_files(experts: dict) -> dict[str, int]:
    """Every experts file a checkpoint with metadata ``experts`` holds -> the rank that wrote it."""
    size = experts["size"]
    return {experts_file_name(i, size): i for i in range(size)}


def _local_params(model, engine) -> list[tuple[str, object, torch.nn.Parameter]]:
    """(fqn, the experts module, parameter) of every rank-local expert parameter, in model order."""
    names = param_names(model)
    out = []
    for *_, module in engine.expert_parallel.replaced:
        for attr in _NAMES:
            p = getattr(module, attr)
            out.append((names[id(p)][0], module, p))
    return out


def _stepper_of(zopts, p) -> tuple[int, object] | None:
    """(optimizer index, its LocalExpertStep) stepping ``p``, or None."""
    for i, zopt in enumerate(zopts):
        rl = zopt.rank_local
        if rl is not None and any(q is p for q in rl.params):
            return i, rl
    return None


def _split_state(fqn: str, p: torch.nn.Parameter, state: dict) -> tuple[dict, dict, list[tuple[str, torch.Tensor]]]:
    """(tensor key -> dtype, scalar key -> entry, (key, [E/N, ...] tensor)) of one local parameter's state."""
    tensors, scalars, values = {}, {}, []
    for key, v in sorted(state.items()):
        if isinstance(v, torch.Tensor) and v.shape == p.shape:
            tensors[key] = dtype_name(v.dtype)
            values.append((key, v))
        elif isinstance(v, torch.Tensor) and v.numel() == 1:
            scalars[key] = {"value": v.item(), "tensor": True, "dtype": dtype_name(v.dtype),
                            "shape": list(v.shape), "on_param_device": v.device == p.device}
        elif v is None or isinstance(v, (bool, int, float)):
            scalars[key] = {"value": v, "tensor": False}
        else:
            raise CheckpointError(
                f"optimizer state {key!r} of the experts {fqn} is neither of the experts' shape {tuple(p.shape)} "
                f"nor a scalar: {type(v).__name__}{tuple(v.shape) if isinstance(v, torch.Tensor) else ''}; "
                "cannot save it per expert")
    return tensors, scalars, values


def local_state_dict(model, engine) -> dict:
    """``model.state_dict(keep_vars=True)`` with the local experts as they are: no gather, so a rank may call
    it alone (a checkpoint's own checks, which other ranks may not reach)."""
    ep = engine.expert_parallel
    with (ep.local_state() if ep is not None else contextlib.nullcontext()):
        return model.state_dict(keep_vars=True)


def expert_pieces(experts: dict, fqn: str, suffix: str = "") -> list[tuple[str, str, int]]:
    """(experts file, tensor name, elements) of each expert of the fused parameter ``fqn`` in expert order:
    laid end to end they are the ``[E, ...]`` tensor's flat elements (``suffix``: ``".state.<key>"`` for
    one optimizer-state tensor). Consolidation streams a fused tensor from them."""
    desc = experts["params"][fqn]
    per, numel = desc["num_experts"] // experts["size"], math.prod(desc["shape"])
    return [(experts_file_name(e // per, experts["size"]), f"{fqn}.{e}{suffix}", numel)
            for e in range(desc["num_experts"])]


def expert_group(meta, optimizer: dict, ckpt: Path, to: str) -> int:
    """The optimizer param group of expert parallelism's experts: the checkpoint does not record which of
    several groups stepped them, so only an optimizer of one group is exported (``to``: the format)."""
    if len(optimizer["param_groups"]) != 1:
        raise CheckpointError(
            f"{ckpt} was saved with expert_parallel_size={meta.experts['size']} and an optimizer of "
            f"{len(optimizer['param_groups'])} param groups, and does not record which group steps the experts: "
            f"{to} is written for an optimizer of one param group; export the weights (and optimizer moments) "
            "with consolidate(..., include_optimizer=True)")
    return 0


# ------------------------------------------------------------------ save
def describe_experts(model, engine, zopts) -> dict | None:
    """The metadata's ``experts`` entry (None without expert parallelism); See [Note: experts in a checkpoint]."""
    ep = engine.expert_parallel
    if ep is None:
        return None
    params, state = {}, {}
    for fqn, module, p in _local_params(model, engine):
        params[fqn] = {"num_experts": int(module.num_experts), "shape": list(p.shape[1:]), "dtype": dtype_name(p.dtype)}
        found = _stepper_of(zopts, p)
        if found is not None and found[1].inner.state.get(p):
            tensors, scalars, _ = _split_state(fqn, p, found[1].inner.state[p])
            state[fqn] = {"optimizer_index": found[0], "tensors": tensors, "scalars": scalars}
    return {"size": int(ep.size), "params": params, "state": state}


def experts_file_entries(model, engine, zopts) -> tuple[str, list, list] | None:
    """(file name, (tensor, dtype, shape) specs, (tensor, value) entries) of the experts file this rank
    writes; None for a rank that writes none (no expert parallelism, or a replica of the first group)."""
    ep = engine.expert_parallel
    if ep is None or not ep.first_group:
        return None
    specs, entries = [], []
    index = None
    for fqn, module, p in _local_params(model, engine):
        index = module.first // module.num_local
        found = _stepper_of(zopts, p)
        state = found[1].inner.state.get(p) if found is not None else None
        values = _split_state(fqn, p, state)[2] if state else []
        for j in range(module.num_local):
            e = module.first + j
            for name, t in [(f"{fqn}.{e}", p.detach())] + [(f"{fqn}.{e}.state.{k}", v) for k, v in values]:
                row = t[j].detach().contiguous()
                specs.append((name, row.dtype, list(row.shape)))
                entries.append((name, row))
    return experts_file_name(index, ep.size), specs, entries


# ------------------------------------------------------------------ load
def wanted_header(experts: dict, index: int) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype name, shape) of every tensor experts file ``index`` holds."""
    size, want = experts["size"], {}
    for fqn, desc in experts["params"].items():
        per = desc["num_experts"] // size
        state = experts["state"].get(fqn, {"tensors": {}})
        for e in range(index * per, (index + 1) * per):
            want[f"{fqn}.{e}"] = (desc["dtype"], list(desc["shape"]))
            for key, dt in state["tensors"].items():
                want[f"{fqn}.{e}.state.{key}"] = (dt, list(desc["shape"]))
    return want


def experts_to_read(meta, model, engine, zopts, ckpt_dir: Path) -> set[str]:
    """Check the checkpoint's experts against the running model's (refused by name where they cannot
    load) and return the experts files this rank reads. Runs in the load's agreed prepare phase."""
    saved, ep = meta.experts, engine.expert_parallel
    if saved is None and ep is None:
        return set()
    if ep is None:
        return _experts_into_flat_groups(meta, model, engine, zopts, ckpt_dir)
    if saved is None:
        raise CheckpointError(
            f"{ckpt_dir} was saved without expert parallelism, and loading it into a model set up with "
            f"expert_parallel_size={ep.size} is not supported yet: resume without expert_parallel_size, or load "
            "the weights before setup (model.load_state_dict of a consolidated state dict, or from_pretrained)")
    files: set[str] = set()
    mine = _local_params(model, engine)
    missing = sorted({fqn for fqn, *_ in mine} - set(saved["params"]))
    unexpected = sorted(set(saved["params"]) - {fqn for fqn, *_ in mine})
    if missing or unexpected:
        raise CheckpointError(f"{ckpt_dir}: the experts do not match the model: missing from the checkpoint: "
                              f"{missing or 'none'}; in the checkpoint but not in the model: {unexpected or 'none'}")
    for fqn, module, p in mine:
        desc = saved["params"][fqn]
        if desc["num_experts"] != module.num_experts or list(desc["shape"]) != list(p.shape[1:]):
            raise CheckpointError(
                f"{ckpt_dir}: {fqn}: the checkpoint holds {desc['num_experts']} experts of shape "
                f"{tuple(desc['shape'])}, the model {module.num_experts} of shape {tuple(p.shape[1:])}")
        found = _stepper_of(zopts, p)
        if zopts and found is not None:
            entry = saved["state"].get(fqn)
            if entry is not None and entry["optimizer_index"] != found[0]:
                raise CheckpointError(f"{ckpt_dir}: the experts {fqn} were stepped by optimizer "
                                      f"{entry['optimizer_index']}, here by optimizer {found[0]}")
        per = desc["num_experts"] // saved["size"]
        files.update(experts_file_name(e // per, saved["size"])
                     for e in range(module.first, module.first + module.num_local))
    return files


def _saved_expert_slots(meta, model, engine):
    """(group, slot, lo, hi, where, checkpoint fqn) of each range of this rank's shards that a saved expert
    parameter fills, in a model without expert parallelism (its experts: ordinary sharded parameters)."""
    names = param_names(model)
    for g in engine.groups:
        for s, lo, hi, where in g.slot_ranges_in_shard():
            fqn = next((n for n in names.get(id(s.param), [s.fqn]) if n in meta.experts["params"]), None)
            if fqn is not None:
                yield g, s, lo, hi, where, fqn


def _experts_into_flat_groups(meta, model, engine, zopts, ckpt_dir: Path) -> set[str]:
    """An expert-parallel checkpoint into a model without expert parallelism: the weights only, each rank
    its shards' rows of each expert (See [Note: experts in a checkpoint])."""
    saved = meta.experts
    fix = ("set up with expert_parallel_size (any divisor of the number of experts and of the world size) to "
           "resume the optimizer too")
    if zopts:
        raise CheckpointError(
            f"{ckpt_dir} was saved with expert_parallel_size={saved['size']}; into a model set up without expert "
            "parallelism only its weights load yet: pass optimizer=None (the optimizer then starts fresh), or "
            + fix)
    found = {}
    names = param_names(model)
    for g in engine.groups:
        for s in g.slots:
            fqn = next((n for n in names.get(id(s.param), [s.fqn]) if n in saved["params"]), None)
            if fqn is not None:
                found[fqn] = (g, s)
    missing = sorted(set(saved["params"]) - set(found))
    if missing:
        raise CheckpointError(f"{ckpt_dir}: the checkpoint's experts {missing} are not sharded parameters of "
                              "this model")
    for fqn, (g, s) in found.items():
        desc = saved["params"][fqn]
        if list(s.shape) != [desc["num_experts"], *desc["shape"]]:
            raise CheckpointError(f"{ckpt_dir}: {fqn}: the checkpoint holds {desc['num_experts']} experts of shape "
                                  f"{tuple(desc['shape'])}, the model a parameter of shape {tuple(s.shape)}")
        if g.master_streams:
            raise CheckpointError(f"{ckpt_dir}: {fqn} is in {g.name}, streamed from NVMe, which an expert-parallel "
                                  f"checkpoint does not load into yet; {fix}")
    files = set()
    for *_, lo, hi, _, fqn in _saved_expert_slots(meta, model, engine):
        desc = saved["params"][fqn]
        rows, per = math.prod(desc["shape"]), desc["num_experts"] // saved["size"]
        files.update(experts_file_name(e // per, saved["size"]) for e in range(lo // rows, (hi - 1) // rows + 1))
    return files


@torch.no_grad()
def fill_flat_from_experts(handle, meta, model, engine) -> None:
    """The saved experts' elements into this rank's master (or frozen) shards of a model without expert
    parallelism (checked by :func:`_experts_into_flat_groups`)."""
    saved = meta.experts
    by_group: dict[int, list] = {}
    for item in _saved_expert_slots(meta, model, engine):
        by_group.setdefault(id(item[0]), []).append(item)
    for items in by_group.values():
        with items[0][0].resident(write_back=True):  # NVMe-swapped masters come in, and go back loaded
            for g, _, lo, hi, where, fqn in items:
                desc = saved["params"][fqn]
                rows, per = math.prod(desc["shape"]), desc["num_experts"] // saved["size"]
                dst = g.weight_shard[where]
                for e in range(lo // rows, (hi - 1) // rows + 1):
                    a, b = max(lo, e * rows), min(hi, (e + 1) * rows)
                    t = handle(experts_file_name(e // per, saved["size"])).get_tensor(f"{fqn}.{e}").reshape(-1)
                    dst[a - lo:b - lo].copy_(t[a - e * rows:b - e * rows])


def _scalar(sc: dict, p: torch.Tensor):
    if not sc["tensor"]:
        return sc["value"]
    dtype = dtype_from_name(sc["dtype"])
    return torch.tensor(sc["value"], dtype=dtype, device=p.device if sc["on_param_device"] else "cpu").reshape(sc["shape"])


@torch.no_grad()
def load_experts(handle, meta, model, engine, zopts) -> None:
    """Copy this rank's experts (and with ``zopts`` their optimizer state) from the verified experts files;
    ``handle(file name)`` -> the opened safetensors file. Every check ran before (:func:`experts_to_read`)."""
    saved = meta.experts
    if saved is None or engine.expert_parallel is None:
        return
    for fqn, module, p in _local_params(model, engine):
        per = saved["params"][fqn]["num_experts"] // saved["size"]
        rows = range(module.first, module.first + module.num_local)

        def read(name_of, e):
            return handle(experts_file_name(e // per, saved["size"])).get_tensor(name_of(e))

        for j, e in enumerate(rows):
            p.data[j].copy_(read(lambda e: f"{fqn}.{e}", e))
        found = _stepper_of(zopts, p) if zopts else None
        if found is None:
            continue
        inner = found[1].inner
        entry = saved["state"].get(fqn)
        if entry is None:  # saved before its first step: it starts fresh, as a flat group does
            inner.state.pop(p, None)
            continue
        state = {key: _scalar(sc, p) for key, sc in entry["scalars"].items()}
        for key, dt in entry["tensors"].items():
            state[key] = torch.stack([read(lambda e: f"{fqn}.{e}.state.{key}", e) for e in rows]).to(
                p.device, dtype_from_name(dt))
        inner.state[p] = state
