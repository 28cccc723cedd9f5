"""DeepSpeed's universal checkpoint: read one into a set-up model, and write one of ours.

[Note: the universal layout]
DeepSpeed's ``ds_to_universal.py`` turns a ZeRO checkpoint into a directory that does not depend
on the saving run's world size or stage, and ``engine.load_checkpoint(dir)`` with
``"checkpoint": {"load_universal": true}`` resumes it (DeepSpeed 0.19: ``checkpoint/
universal_checkpoint.py``, ``runtime/base_optimizer.py``, ``runtime/zero/stage3.py``)::

    dir/latest_universal                         names the tag, e.g. global_step3_universal
    dir/<tag>/mp_rank_00_model_states.pt         what stages 1-2 read: global_steps, dp_world_size,
                                                 lr_scheduler, client state (not the module: weights
                                                 come from zero/)
    dir/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same, as stage 3 looks for it
    dir/<tag>/zero/optimizer_state.pt            the optimizer's param groups (stages 1-2: "param_groups";
                                                 stage 3: "optimizer_state_dict" {"state": {0: {"step"}},
                                                 "param_groups"}), loss scaler, ds_version
    dir/<tag>/zero/<name>/fp32.pt                {"param": the whole fp32 master, "cat_dim": 0}
    dir/<tag>/zero/<name>/exp_avg.pt             the same for each optimizer state tensor
    dir/<tag>/zero/<name>/step.pt                the parameter's step count (stages 1-2)

``<name>`` is the parameter's first name in ``named_parameters()`` (DeepSpeed's ``param_names``),
so a tied parameter has one folder. A loading rank cuts its own fragment out of each whole
tensor, so the directory fits any world size and any stage.

What DeepSpeed does not restore from it (its loader, not this file, decides): buffers and frozen
parameters (the module state dict is not loaded; they keep the values the model was built with),
and at stage 3 the hyperparameters of param groups after the first (every group takes group 0's).

Reading (:class:`UniversalCheckpoint`) takes each rank's element ranges out of the whole tensors,
memory-mapped, through the same load as a ZeRO checkpoint (the files are pickles: See
[Note: unpickling DeepSpeed's files] in _deepspeed.py). Writing (:func:`export_universal`) holds
one parameter's tensor at a time.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ._deepspeed import _DEEPSPEED_KEYS, DeepSpeedCheckpoint, _Param, safe_load
from ._experts import expert_group, expert_pieces
from ._layout import BUFFERS_FILE, CheckpointError, Metadata, dtype_from_name

OPTIMIZER_STATE = "optimizer_state.pt"
#: the DeepSpeed version whose layout the export writes (its loader asserts that one is named)
DS_LAYOUT_VERSION = "0.19.8"
UNIVERSAL_VERSION = 0.4


def is_universal(tag_dir: Path) -> bool:
    return (tag_dir / "zero" / OPTIMIZER_STATE).is_file()


# ------------------------------------------------------------------ reading
class UniversalCheckpoint(DeepSpeedCheckpoint):
    """A DeepSpeed universal checkpoint's tag directory, read as a ZeRO checkpoint is: the same
    names, shapes, groups and checks (See [Note: the universal layout]); each parameter's tensors are
    whole, one file each, so a range of elements is a slice of one file."""

    def __init__(self, tag_dir: Path):
        self.dir = tag_dir
        zero = tag_dir / "zero"
        self.optim_files = [zero / OPTIMIZER_STATE]
        optim = safe_load(self.optim_files[0])
        if not isinstance(optim, dict):
            raise CheckpointError(f"{self.optim_files[0]} is not a DeepSpeed universal optimizer state")
        self.optim = [optim]
        model_file = next((tag_dir / n for n in ("mp_rank_00_model_states.pt",
                                                 "zero_pp_rank_0_mp_rank_00_model_states.pt")
                           if (tag_dir / n).is_file()), None)
        if model_file is None:
            raise CheckpointError(f"{tag_dir}: no mp_rank_00_model_states.pt (nor zero_pp_rank_0_...): not a "
                                  "complete universal checkpoint")
        self.model_file = model_file
        self.model_states = safe_load(model_file)
        self._model_states_of = {0: self.model_states}
        self.config = self.model_states.get("ds_config") or {}
        self.shared = dict(self.model_states.get("shared_params") or {})
        self.world = int(self.model_states.get("dp_world_size") or 1)
        self._files: dict[tuple[str, str], torch.Tensor] = {}
        stage3 = int(optim.get("zero_stage", 0) or 0) == 3
        self.stage = 3 if stage3 else 2
        base = optim.get("optimizer_state_dict") if stage3 else optim
        if not isinstance(base, dict) or not isinstance(base.get("param_groups"), list):
            raise CheckpointError(f"{self.optim_files[0]} holds no optimizer param groups")
        self.param_groups = base["param_groups"]
        shapes = self._param_shapes()
        # stage 3 lists sub-groups; its param groups name them in order (See _layout_3 in _deepspeed.py)
        owner = ([g for g, pg in enumerate(self.param_groups) for _ in pg["params"]] if stage3
                 else list(range(len(shapes))))
        if len(owner) != len(shapes):
            raise CheckpointError(f"{self.optim_files[0]}: {len(owner)} optimizer groups, the model-states file "
                                  f"lists {len(shapes)}")
        self.params: dict[str, _Param] = {}
        for k, group in enumerate(shapes):
            for name, shape in group.items():
                self.params[name] = _Param(name, tuple(shape), math.prod(shape), k, 0, owner[k])
        self.frozen = self._frozen()
        for name in list(self.params) + list(self.frozen):  # each names a folder inside zero/
            if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
                raise CheckpointError(f"{model_file} names a parameter {name!r}, which is not a folder inside "
                                      f"{zero}")
        self.state_keys = self._state_keys()
        step0 = ((base.get("state") or {}).get(0) or {}).get("step") if stage3 else None
        self.steps = [self._group_step(k, step0) for k in range(len(shapes))]

    def _state_keys(self) -> list[str]:
        keys = None
        for name in self.params:
            folder = self.dir / "zero" / name
            if not (folder / "fp32.pt").is_file():
                raise CheckpointError(f"{folder / 'fp32.pt'} is missing: the universal checkpoint lacks {name}")
            found = {p.name[:-3] for p in folder.glob("*.pt")} - {"fp32", "step"}
            if keys is not None and found != keys:
                raise CheckpointError(f"{folder}: optimizer state {sorted(found)} differs from {sorted(keys)}")
            keys = found
        return sorted(keys or ())

    def _group_step(self, k: int, fallback):
        values = set()
        for p in self.params.values():
            if p.flat != k:
                continue
            path = self.dir / "zero" / p.name / "step.pt"
            step = safe_load(path) if path.is_file() else fallback
            if step is not None:
                values.add(float(step))
        if len(values) > 1:
            raise CheckpointError(f"{self.dir}: parameters of group {k} were saved at different step counts "
                                  f"{sorted(values)}")
        return values.pop() if values else None

    def _whole(self, name: str, key: str) -> torch.Tensor:
        """The whole tensor ``key`` (fp32 or a state key) of ``name``, flattened, memory-mapped."""
        if (name, key) not in self._files:
            path = self.dir / "zero" / name / f"{key}.pt"
            if not path.is_file():
                raise CheckpointError(f"{path} is missing")
            value = safe_load(path)
            t = value.get("param") if isinstance(value, dict) else value
            want = math.prod(self.shape_of(name))
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() != want:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointError(f"{path}: expected a float tensor of {want} elements, found {got}")
            self._files[(name, key)] = t.reshape(-1)
        return self._files[(name, key)]

    def fill(self, dst: torch.Tensor, name: str, lo: int, hi: int, key: str | None) -> None:
        dst.copy_(self._whole(name, key or "fp32")[lo:hi])

    def fill_frozen(self, dst: torch.Tensor, name: str, lo: int, hi: int) -> None:
        if (self.dir / "zero" / name / "fp32.pt").is_file():
            dst.copy_(self._whole(name, "fp32")[lo:hi])
        else:
            dst.copy_(self.model_states["module"][name].reshape(-1)[lo:hi])

    def load_frozen_files(self) -> None:
        module = self.model_states.get("module") or {}
        for name in self.frozen:
            if not (self.dir / "zero" / name / "fp32.pt").is_file() and name not in module:
                raise CheckpointError(f"{self.dir}: frozen parameter {name} is neither in zero/ nor in the module "
                                      "state dict")

    def close(self) -> None:
        self._files.clear()
        super().close()


# ------------------------------------------------------------------ writing
def export_universal(out: Path, meta: Metadata, files, ckpt: Path) -> None:
    """Write checkpoint ``ckpt`` (``meta``; its rank files opened as ``files``: ``range(rank, tensor, a,
    b)``) as a DeepSpeed universal checkpoint in the new directory ``out`` (See [Note: the universal
    layout]): what ``engine.load_checkpoint(out)`` takes, ``latest_universal`` naming the tag
    ``global_step<N>_universal`` (N: the optimizer's step count, as DeepSpeed names its own)."""
    optimizers = meta.optimizers if meta.optimizers is not None else ([meta.optimizer] if meta.optimizer else [])
    if len(optimizers) != 1:
        raise CheckpointError(f"{ckpt} holds the state of {len(optimizers)} optimizers; a DeepSpeed checkpoint "
                              "holds one: export the weights alone with consolidate")
    if meta.precision == "fp16":
        raise CheckpointError(f"{ckpt} was saved by an fp16 run, whose loss scale a DeepSpeed universal checkpoint "
                              "would not carry: export the weights with consolidate")
    shapes: list[OrderedDict] = [OrderedDict() for _ in optimizers[0]["param_groups"]]
    frozen_shapes: dict[str, torch.Size] = {}
    first_step = next((float(g.state_scalars["step"]["value"]) for g in meta.groups
                       if g.trainable and "step" in g.state_scalars), 0.0)
    tag = f"global_step{int(first_step)}_universal"
    zero = out / tag / "zero"
    for fqn, p in meta.params.items():
        group = meta.groups[p.group]
        if group.owned or group.param_state:
            raise CheckpointError(f"{ckpt}: {fqn}'s optimizer state is kept whole per parameter (the ownership "
                                  "layout), which DeepSpeed does not read: export the weights with consolidate")
        folder = zero / fqn
        folder.mkdir(parents=True)
        _save_whole(folder / "fp32.pt", meta, files, fqn, group.weight_tensor, torch.float32)
        if not group.trainable:
            frozen_shapes[fqn] = torch.Size(p.shape)
            continue
        shapes[group.optimizer_group][fqn] = torch.Size(p.shape)
        for key in group.state_tensors:
            _save_whole(folder / f"{key}.pt", meta, files, fqn, group.state_tensor(key), None)
        step = group.state_scalars.get("step")
        if step is not None:
            torch.save(torch.tensor(float(step["value"]), dtype=torch.float32), folder / "step.pt")
    if meta.experts is not None:  # See [Note: experts in a checkpoint] in _experts.py
        _export_experts(zero, meta, files, shapes[expert_group(meta, optimizers[0], ckpt, "a DeepSpeed checkpoint")])
    param_groups = [dict({k: tuple(v) if isinstance(v, list) else v for k, v in pg.items()}, params=[j])
                    for j, pg in enumerate(optimizers[0]["param_groups"])]
    torch.save({"param_groups": param_groups, "ds_version": DS_LAYOUT_VERSION, "overflow": False,
                "optimizer_state_dict": {"state": {0: {"step": torch.tensor(first_step)}},
                                         "param_groups": param_groups}},
               zero / OPTIMIZER_STATE)
    buffers = {}
    if any(kind == "buffer" for _, kind, _ in meta.state_dict_keys):
        from safetensors import safe_open
        with safe_open(str(ckpt / BUFFERS_FILE), framework="pt") as f:
            buffers = {key: f.get_tensor(name) for key, kind, name in meta.state_dict_keys if kind == "buffer"}
    extra = meta.extra_state["value"] if meta.extra_state and meta.extra_state["kind"] == "json" else None
    # a dict extra_state is DeepSpeed's client_state; its "lr_scheduler" entry, the engine's scheduler state
    states: dict[str, Any] = dict(extra) if isinstance(extra, dict) and not set(extra) & (_DEEPSPEED_KEYS - {
        "lr_scheduler"}) else {}
    states.update({
        "module": buffers, "buffer_names": list(buffers), "param_shapes": shapes,
        "frozen_param_shapes": frozen_shapes,
        "shared_params": {name: fqn for fqn, p in meta.params.items() for name in p.names if name != fqn},
        "dp_world_size": meta.world_size, "mp_world_size": 1, "global_steps": int(first_step),
        "skipped_steps": 0, "lr_scheduler": states.pop("lr_scheduler", None), "ds_version": DS_LAYOUT_VERSION,
        "universal_checkpoint_info": {"universal_checkpoint_version": UNIVERSAL_VERSION},
    })
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        torch.save(states, out / tag / name)
    (out / "latest_universal").write_text(tag)


def _export_experts(zero: Path, meta: Metadata, files, shapes: OrderedDict) -> None:
    """Expert parallelism's experts as whole fused parameters ``[E, ...]``: ``fp32.pt`` and each elementwise
    state tensor (Adam's ``exp_avg``, ``exp_avg_sq``) the experts' rows end to end, as DeepSpeed keeps a
    parameter's, and ``step.pt``; their shapes join the param group's (in the model's order)."""
    for fqn, desc in meta.experts["params"].items():
        folder = zero / fqn
        folder.mkdir(parents=True)
        shape = torch.Size([desc["num_experts"], *desc["shape"]])
        _save_fused(folder / "fp32.pt", meta, files, fqn, "", shape)
        shapes[fqn] = shape
        entry = meta.experts["state"].get(fqn)
        if entry is None:  # saved before its first step
            continue
        for key in entry["tensors"]:
            _save_fused(folder / f"{key}.pt", meta, files, fqn, f".state.{key}", shape)
        step = entry["scalars"].get("step")
        if step is not None:
            torch.save(torch.tensor(float(step["value"]), dtype=torch.float32), folder / "step.pt")
    order = {name: i for i, (_, _, name) in enumerate(meta.state_dict_keys)}
    for fqn in sorted(shapes, key=lambda n: order.get(n, len(order))):
        shapes.move_to_end(fqn)


def _save_fused(path: Path, meta: Metadata, files, fqn: str, suffix: str, shape: torch.Size) -> None:
    """One fused experts tensor rebuilt from its per-expert tensors (the experts files), saved whole in fp32."""
    whole = torch.empty(shape, dtype=torch.float32)
    for e, (name, tensor, _) in enumerate(expert_pieces(meta.experts, fqn, suffix)):
        whole[e].copy_(files.handle(name).get_tensor(tensor).reshape(shape[1:]))
    torch.save({"param": whole, "cat_dim": 0}, path)


def _save_whole(path: Path, meta: Metadata, files, fqn: str, tensor: str, dtype: torch.dtype | None) -> None:
    """One parameter's tensor ``tensor`` gathered from the rank files, saved whole in its shape."""
    p = meta.params[fqn]
    whole = torch.empty(p.numel, dtype=dtype or _stored(meta, p, tensor))
    for rank, a, b, at in meta.pieces(fqn, 0, p.numel):
        whole[at:at + b - a].copy_(files.range(rank, tensor, a, b))
    torch.save({"param": whole.view(p.shape).float(), "cat_dim": 0}, path)


def _stored(meta: Metadata, p, tensor: str) -> torch.dtype:
    group = meta.groups[p.group]
    key = next((k for k in group.state_tensors if group.state_tensor(k) == tensor), None)
    return dtype_from_name(group.state_tensors[key] if key else group.dtype)
