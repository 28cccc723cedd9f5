"""Read a DeepSpeed ZeRO checkpoint (stages 1-3) into a set-up model, at any world size and stage.

[Note: DeepSpeed's layout]
``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/``::

    mp_rank_00_model_states.pt                     stages 1-2: module state dict (compute dtype),
                                                   param_shapes, shared_params, buffer_names, ...
    zero_pp_rank_<r>_mp_rank_00_model_states.pt    stage 3: the same, one per rank, with each
                                                   rank's fragment of every frozen parameter
    [bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r's fp32 masters and optimizer state

``param_shapes`` lists, per flat group of the saving run, each trainable parameter's name and
shape in the order the flat buffer holds them (stages 1-2: one group per optimizer param group,
in DeepSpeed's round-robin order; stage 3: one per sub-group). How a parameter's elements are
spread over the rank files (what ``utils/zero_to_fp32.py`` undoes):

* stages 1-2: the group's parameters lie end to end, each followed by
  ``param_alignment_paddings[g][j]`` elements; the padded group is cut into ``partition_count``
  equal partitions of P elements, rank r holding elements [r*P, (r+1)*P).
  ``single_partition_of_fp32_groups[g]`` is that partition less ``group_paddings[g]`` trailing
  padding; the optimizer's state tensors (``base_optimizer_state``) are the padded partition
  (or the lean one, in DeepSpeed's "elastic" form).
* stage 3: every parameter is split on its own into W parts of ceil(numel/W) elements (the last
  padded); rank r's ``fp32_flat_groups[k]`` is its part of each parameter of sub-group k, end
  to end, and the optimizer's ``state`` entry of that sub-group has the same layout.

At stage 3 with ``offload_optimizer.device: nvme`` the rank files hold, for each sub-group DeepSpeed
swapped to NVMe, empty tensors instead: See [Note: NVMe-swapped sub-groups].

So element e of a parameter sits at a computable (rank file, group, offset): :meth:`DeepSpeedCheckpoint.pieces`
says which, and a load copies each rank's own element ranges straight out of the rank files,
memory-mapped, as our own format does (See [Note: re-sharding by name] in _load.py): no whole
parameter, group or model is assembled in memory.

[Note: unpickling DeepSpeed's files]
DeepSpeed's files are pickles (``torch.save``); a pickle can run any code when loaded. They are
read with ``torch.load(weights_only=True)``, which builds nothing outside torch's own safe
types, plus an allowlist of the three DeepSpeed types 0.19 writes into them: the loss scaler
(``LossScaler`` / ``DynamicLossScaler``, a plain object), ``ZeroStageEnum`` (an int) and
``fragment_address`` (two ints). None of them is imported: each is read into an inert
stand-in here (its attributes only), so reading a checkpoint needs no DeepSpeed and runs none
of its code. Any other type in a file refuses the load, naming the file and the type.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._layout import CheckpointError

#: what DeepSpeed writes into a model-states file besides the user's ``client_state``
_DEEPSPEED_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config",
    "ds_version", "universal_checkpoint_info",
}
_OPTIM_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


# ------------------------------------------------------------------ unpickling
class _Attributes:
    """Stand-in for a DeepSpeed object in a checkpoint: its attributes, nothing callable.
    See [Note: unpickling DeepSpeed's files]."""

    def __setstate__(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise TypeError(f"unexpected state of type {type(state).__name__}")
        self.__dict__.update(state)


def _zero_stage(value: int) -> int:
    """``ZeroStageEnum(value)`` read as the plain int it is."""
    if type(value) is not int:
        raise TypeError(f"ZeroStageEnum of {type(value).__name__}")
    return value


_ALLOWED = [
    (_Attributes, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Attributes, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Attributes, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]


def safe_load(path: Path) -> Any:
    """``torch.load`` of a DeepSpeed file, memory-mapped, with only the allowlisted types.
    See [Note: unpickling DeepSpeed's files]."""
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    if safe_globals is None:
        raise CheckpointError(f"reading DeepSpeed checkpoints needs torch >= 2.6 (this is {torch.__version__})")
    with safe_globals(_ALLOWED):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:  # noqa: BLE001 - pickle refusals come in several types
            found = re.search(r"GLOBAL ([\w.]+)", str(err))
            if found:
                raise CheckpointError(
                    f"{path} holds a pickled object of type {found.group(1)}, which is not one of the types a "
                    "DeepSpeed checkpoint holds: refused (DeepSpeed files are read with torch.load(weights_only=True) "
                    "and an allowlist; an unknown type could run code when unpickled)") from None
            raise CheckpointError(f"{path} is not a readable DeepSpeed checkpoint file: "
                                  f"{type(err).__name__}: {str(err)[:300]}") from None


# [Note: NVMe-swapped sub-groups]
# DeepSpeed 0.19's stage 3 with ``offload_optimizer.device: nvme`` keeps a sub-group's fp32 master and
# Adam state in swap files (its ``PartitionedOptimizerSwapper``) when the rank's part of the sub-group
# reaches the I/O minimum (1 MiB, or the aio block size); smaller ones stay in memory. Its
# ``save_checkpoint`` writes the rank files as ever, where a swapped sub-group's tensors are empty
# (0 elements), and copies the swap folder (gradients left out) into ``<tag>/offloaded_tensors/rank<NN>/``
# (``load_checkpoint`` copies it back). The empty tensors keep, pickled with them, the ``ds_id`` the
# swapper named each file by: ``<ds_id>.tensor.swp`` for the master (``ds_id`` "<first>_<last>": the
# sub-group's parameter ids), ``<state>-<ds_id>.tensor.swp`` for each Adam tensor, the ``ds_id`` of
# the state tensor itself. A file is the tensor's raw fp32 elements, padded at the end to the I/O
# alignment. So the checkpoint says where each swapped tensor is, and it is read from there,
# memory-mapped, as the rank files are. Stages 1-2 with NVMe offload keep the optimizer in CPU memory
# (DeepSpeed has no swapper there): their files are complete. Parameters offloaded to NVMe
# (``offload_param``) are not needed: the fp32 masters are the weights, and the frozen parameters'
# fragments are in the model-states files.
_SWAP_FOLDER = "offloaded_tensors"
_SWAP_ID = re.compile(r"(?:[A-Za-z_]\w*-)?\d+_\d+")


def _swapped_tensor(tag_dir: Path, rank: int, t: torch.Tensor, numel: int, what: str) -> torch.Tensor:
    """The ``numel`` fp32 elements DeepSpeed swapped out for the empty ``t`` of rank ``rank``'s file,
    memory-mapped from its swap file. See [Note: NVMe-swapped sub-groups]."""
    swap_id = getattr(t, "ds_id", None)
    if not isinstance(swap_id, str) or not _SWAP_ID.fullmatch(swap_id):
        raise CheckpointError(f"{tag_dir}: rank {rank}'s {what} is empty and names no swap file (ds_id "
                              f"{swap_id!r}): not a DeepSpeed NVMe-offload checkpoint that is read")
    path = tag_dir / _SWAP_FOLDER / f"rank{rank:0>2d}" / f"{swap_id}.tensor.swp"
    if not path.is_file() or path.is_symlink():
        raise CheckpointError(
            f"{path} is missing: DeepSpeed swapped rank {rank}'s {what} to NVMe, and its save_checkpoint copies the "
            f"swap files into {_SWAP_FOLDER}/ of the tag directory; copy the checkpoint with that folder, or resume "
            "it in DeepSpeed and save it again with offload_optimizer.device 'cpu'")
    size = path.stat().st_size
    if size % 4 or size < numel * 4:
        raise CheckpointError(f"{path} holds {size} bytes, not the {numel} fp32 elements of rank {rank}'s {what}")
    return torch.from_file(str(path), shared=False, size=size // 4, dtype=torch.float32)[:numel]


# ------------------------------------------------------------------ finding it
def find_deepspeed_checkpoint(path: Path) -> Path | None:
    """The tag directory (``global_stepN/``) when ``path`` is a DeepSpeed checkpoint: the run's
    directory with its ``latest`` (or ``latest_universal``) file, or the tag directory itself. None:
    not DeepSpeed's.
    Refuses the DeepSpeed forms not read here, saying what to do instead."""
    for name in ("latest", "latest_universal"):  # universal: See [Note: the universal layout] in _deepspeed_universal.py
        if (path / name).is_file():
            path = _tagged(path, name)
            break
    if (path / "zero").is_dir() and not _optim_files(path):
        if not (path / "zero" / "optimizer_state.pt").is_file():
            raise CheckpointError(f"{path} has a zero/ folder but no zero/optimizer_state.pt: an incomplete "
                                  "DeepSpeed universal checkpoint")
        return path
    if _optim_files(path) or list(path.glob("*_model_states.pt")):
        return path
    tags = sorted(p.name for p in path.glob("global_step*") if p.is_dir())
    if tags:
        raise CheckpointError(f"{path} has DeepSpeed tag directories {tags[:5]} but no 'latest' file naming one: "
                              f"pass the tag directory itself (for example {path / tags[-1]})")
    return None


def deepspeed_lr_scheduler_state(path: str | Path) -> dict | None:
    """The state of the LR scheduler a DeepSpeed run's engine had (``lr_scheduler`` of its model-states
    file), or None: a directory that is not DeepSpeed's, or a run without one."""
    tag = find_deepspeed_checkpoint(Path(path))
    if tag is None:
        return None
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (tag / name).is_file():
            state = safe_load(tag / name).get("lr_scheduler")
            return state if isinstance(state, dict) else None
    return None


def _tagged(path: Path, latest_name: str) -> Path:
    """The tag directory that ``path/<latest_name>`` names, inside ``path``."""
    latest = path / latest_name
    tag = latest.read_text(errors="replace").strip()
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\0" in tag:
        raise CheckpointError(f"{latest} names {tag!r}, not a checkpoint tag inside {path}")
    tagged = path / tag
    if not tagged.is_dir() or tagged.is_symlink():
        raise CheckpointError(f"{latest} names tag {tag!r} but {tagged} is not a directory")
    return tagged


def _optim_files(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if _OPTIM_FILE.fullmatch(p.name)] if path.is_dir() else []


# ------------------------------------------------------------------ the layout
@dataclass(frozen=True)
class _Param:
    """Where a trainable parameter's elements sit in the saved flat groups."""
    name: str
    shape: tuple[int, ...]
    numel: int
    flat: int          # index of its flat group (stages 1-2: param group; stage 3: sub-group)
    offset: int        # stages 1-2: element offset in the group; stage 3: offset of its part in each rank's group
    param_group: int   # the optimizer param group it belongs to


class DeepSpeedCheckpoint:
    """A DeepSpeed ZeRO checkpoint's tag directory, its files read (memory-mapped) and checked.

    Tensors stay in the files until :meth:`fill` copies an element range out of them.
    """

    def __init__(self, tag_dir: Path):
        self.dir = tag_dir
        optim = sorted(_optim_files(tag_dir), key=lambda p: int(_OPTIM_FILE.fullmatch(p.name).group(2)))
        if not optim:
            raise CheckpointError(f"{tag_dir} holds no DeepSpeed ZeRO optimizer files (*_optim_states.pt): only "
                                  "checkpoints of ZeRO stages 1-3 are read (a stage-0 run: load its "
                                  "mp_rank_00_model_states.pt 'module' with load_full_state_dict)")
        if any(_OPTIM_FILE.fullmatch(p.name).group(3) != "00" for p in optim) or list(tag_dir.glob("*expert_*")):
            raise CheckpointError(f"{tag_dir} was saved with tensor/pipeline or expert parallelism (mp_rank or "
                                  "expert files other than 00), which is not read")
        ranks = [int(_OPTIM_FILE.fullmatch(p.name).group(2)) for p in optim]
        if ranks != list(range(len(optim))):
            raise CheckpointError(f"{tag_dir}: optimizer files of ranks {ranks}: a rank's file is missing")
        self.optim_files = optim
        self.optim = [_optimizer_state(p) for p in optim]
        first = self.optim[0]
        if not isinstance(first, dict) or "zero_stage" not in first:
            raise CheckpointError(f"{optim[0]} is not a DeepSpeed ZeRO optimizer file (no zero_stage)")
        self.stage = int(first["zero_stage"])
        if self.stage not in (1, 2, 3):
            raise CheckpointError(f"{optim[0]}: ZeRO stage {self.stage}; stages 1-3 are read")
        count = first["partition_count"]
        self.world = max(count) if isinstance(count, list) else int(count)
        if self.world != len(optim):
            raise CheckpointError(f"{tag_dir}: saved by {self.world} ranks but {len(optim)} optimizer files are there")
        model_name = "mp_rank_00_model_states.pt" if self.stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
        model_file = tag_dir / model_name
        if not model_file.is_file():
            raise CheckpointError(f"{tag_dir}: {model_name} is missing")
        self.model_file = model_file
        self.model_states = safe_load(model_file)
        self._model_states_of: dict[int, dict] = {0: self.model_states}
        self.config = self.model_states.get("ds_config") or {}
        self._check_supported()
        self.shared: dict[str, str] = dict(self.model_states.get("shared_params") or {})
        self.params: dict[str, _Param] = {}
        if self.stage < 3:
            self._layout_1_2()
        else:
            self._layout_3()
        self.frozen = self._frozen()

    # -------------------------------------------------------------- checks
    def _check_supported(self) -> None:
        for r, sd in enumerate(self.optim):
            if int(sd.get("zero_stage", -1)) != self.stage:
                raise CheckpointError(f"{self.optim_files[r]}: ZeRO stage differs from rank 0's {self.stage}")
            if self.stage == 3 and sd.get("ds_zero_partition_groups") is not None:
                raise CheckpointError(f"{self.dir} partitions expert groups separately (AutoEP), which is not read")

    @property
    def fp16(self) -> bool:
        """Saved by an fp16 run: its loss scaler's state means something."""
        scaler = self.optim[0].get("loss_scaler")
        dynamic = bool(self.optim[0].get("dynamic_loss_scale")) or bool(getattr(scaler, "dynamic", False))
        return bool((self.config.get("fp16") or {}).get("enabled")) or dynamic or \
            float(getattr(scaler, "cur_scale", 1.0)) != 1.0

    def loss_scale_state(self, ours: dict, growth_interval: int) -> dict | None:
        """DeepSpeed's loss scaler as our ``LossScaler``'s state (``ours``: its current one, for what
        DeepSpeed does not say); None where the run did not scale its loss (fp32, bf16).

        [Note: DeepSpeed's loss scale, carried over]
        DeepSpeed's ``DynamicLossScaler`` counts iterations: on a step without overflow it grows the
        scale when ``stable = cur_iter - last_overflow_iter - 1`` (good steps before this one since the
        last overflow) is a positive multiple of ``scale_window``, so the next growth comes after
        ``m * scale_window - stable + 1`` more good steps (m the least with ``m * scale_window >=
        max(stable, 1)``). Ours counts good steps up to ``growth_interval``: ``good_steps`` is set so
        that the same number of good steps remains (it is negative right after an overflow, where
        DeepSpeed waits one step longer than a window). ``cur_hysteresis`` is our ``hysteresis_left``.

        That makes the next growth or back-off after the load fall on DeepSpeed's step; after it the
        two policies part in two places (our ``LossScaler`` in _optim/optimizer.py, compared step by
        step with DeepSpeed 0.19.8's ``DynamicLossScaler(consecutive_hysteresis=False)``, its default):
        * growth: DeepSpeed grows at the (window + 1)-th good step after the start or after any
          overflow (``stable`` counts the steps *before* this one), then every window good steps; ours
          grows at every window-th good step, so one step earlier after the start and after each
          overflow;
        * hysteresis: after a back-off DeepSpeed leaves ``cur_hysteresis`` at 1 until the next growth
          restores it (so each further overflow backs off at once); ours restores ``hysteresis`` at the
          back-off, so with ``hysteresis > 1`` ours skips that many overflows again first.
        With ``hysteresis: 1`` only the first differs. A DeepSpeed run resumed here keeps DeepSpeed's
        schedule up to its next overflow or growth, then follows ours.
        """
        scaler = self.optim[0].get("loss_scaler")
        if scaler is None or not self.fp16:
            return None
        try:
            state = dict(ours, scale=float(scaler.cur_scale))
            if getattr(scaler, "dynamic", False):
                stable = int(scaler.cur_iter) - int(scaler.last_overflow_iter) - 1
                window = int(scaler.scale_window)
                m = max(1, math.ceil(stable / window))
                state["good_steps"] = growth_interval - (m * window - stable + 1)
                state["hysteresis_left"] = int(scaler.cur_hysteresis)
        except (AttributeError, TypeError, ValueError) as err:
            raise CheckpointError(f"{self.optim_files[0]}: the loss scaler's state is not DeepSpeed's ({err})") from None
        return state

    def lr_scheduler_state(self) -> dict | None:
        """The state of the LR scheduler the DeepSpeed engine had (``lr_scheduler``), or None."""
        state = self.model_states.get("lr_scheduler")
        return state if isinstance(state, dict) else None

    def _param_shapes(self) -> list[dict]:
        shapes = self.model_states.get("param_shapes")
        if not isinstance(shapes, list) or not all(isinstance(s, dict) for s in shapes):
            raise CheckpointError(f"{self.model_file} has no param_shapes: not a ZeRO checkpoint")
        return shapes

    def _tensor(self, where: str, t: Any, numel: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != numel or not t.is_floating_point():
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(f"{where}: expected a 1-D float tensor of {numel} elements, found {got}")
        return t

    # -------------------------------------------------------------- stages 1-2
    def _layout_1_2(self) -> None:
        if self._elastic:
            raise CheckpointError(f"{self.dir} uses DeepSpeed's elastic checkpoint form "
                                  "(zero_optimization.elastic_checkpoint), which is not read yet")
        shapes = self._param_shapes()
        aligns = self.optim[0].get("param_alignment_paddings") or [[0] * len(s) for s in shapes]
        self.partition: list[int] = []       # P per group: the padded partition's length
        self._lean: list[list[int]] = []     # per rank, per group: elements that are not padding
        for r, sd in enumerate(self.optim):
            fp32, pads = sd.get("single_partition_of_fp32_groups"), sd.get("group_paddings")
            if not isinstance(fp32, list) or len(fp32) != len(shapes) or len(pads) != len(shapes):
                raise CheckpointError(f"{self.optim_files[r]}: {len(fp32 or [])} fp32 groups, the model-states "
                                      f"file lists {len(shapes)}")
            self._lean.append([int(t.numel()) for t in fp32])
            sizes = [int(t.numel()) + int(p) for t, p in zip(fp32, pads)]
            if r == 0:
                self.partition = sizes
            elif sizes != self.partition:
                raise CheckpointError(f"{self.optim_files[r]}: partition sizes {sizes} differ from rank 0's "
                                      f"{self.partition}")
        for g, group in enumerate(shapes):
            offset = 0
            for j, (name, shape) in enumerate(group.items()):
                numel = math.prod(shape)
                self.params[name] = _Param(name, tuple(shape), numel, g, offset, g)
                offset += numel + int(aligns[g][j])
            if offset > self.partition[g] * self.world:
                raise CheckpointError(f"{self.dir}: group {g}'s parameters need {offset} elements, its partitions "
                                      f"hold {self.partition[g] * self.world}")
        self._state_index = [pg["params"][0] if len(pg["params"]) == 1 else None
                             for pg in self._base(0)["param_groups"]]
        if len(self._state_index) != len(shapes) or None in self._state_index:
            raise CheckpointError(f"{self.optim_files[0]}: the optimizer's param groups do not hold one flat "
                                  f"group each ({len(shapes)} groups)")
        self.param_groups = self._base(0)["param_groups"]
        self._check_states(lambda r, g: self.partition[g], len(shapes))

    @property
    def _elastic(self) -> bool:
        """DeepSpeed's "elastic" form of stages 1-2: a list of lean per-group states."""
        return isinstance(self.optim[0].get("base_optimizer_state"), list)

    def _base(self, r: int) -> dict:
        key = "base_optimizer_state" if self.stage < 3 else "optimizer_state_dict"
        return self.optim[r][key]

    # -------------------------------------------------------------- stage 3
    def _layout_3(self) -> None:
        shapes = self._param_shapes()
        base = self._base(0)
        # state_dict() numbers the flat sub-groups after DeepSpeed appended each to its param group, in
        # sub-group order (stage3.py _set_fp32_optimizer_param_groups): the k-th number is sub-group k
        order = [(idx, g) for g, pg in enumerate(base["param_groups"]) for idx in pg["params"]]
        if len(order) != len(shapes):
            raise CheckpointError(f"{self.optim_files[0]}: {len(order)} optimizer sub-groups, the model-states "
                                  f"file lists {len(shapes)}")
        self._state_index = [idx for idx, _ in order]
        self.sub_numel: list[int] = []
        for k, group in enumerate(shapes):
            offset = 0
            for name, shape in group.items():
                numel = math.prod(shape)
                self.params[name] = _Param(name, tuple(shape), numel, k, offset, order[k][1])
                offset += math.ceil(numel / self.world)
            self.sub_numel.append(offset)
        for r, sd in enumerate(self.optim):
            flat = sd.get("fp32_flat_groups")
            if not isinstance(flat, list) or len(flat) != len(shapes):
                raise CheckpointError(f"{self.optim_files[r]}: {len(flat or [])} fp32 groups, expected {len(shapes)}")
            self._swapped_in(r, flat, order)
            for k, t in enumerate(flat):
                self._tensor(f"{self.optim_files[r]} fp32_flat_groups[{k}]", t, self.sub_numel[k])
        self.param_groups = base["param_groups"]
        self._check_states(lambda r, k: self.sub_numel[k], len(shapes))

    def _swapped_in(self, r: int, flat: list, order: list) -> None:
        """Rank ``r``'s NVMe-swapped sub-groups (empty in its file) mapped from their swap files, in place
        of the empty tensors. See [Note: NVMe-swapped sub-groups]."""
        state = self._base(r).get("state") or {}
        for k, t in enumerate(flat):
            if not (isinstance(t, torch.Tensor) and t.numel() == 0 and self.sub_numel[k] > 0):
                continue
            flat[k] = _swapped_tensor(self.dir, r, t, self.sub_numel[k], f"fp32 sub-group {k}")
            entry = state.get(order[k][0]) or {}
            for key, v in entry.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == 0:
                    entry[key] = _swapped_tensor(self.dir, r, v, self.sub_numel[k], f"{key} of sub-group {k}")

    def _check_states(self, numel_of, groups: int) -> None:
        """Every rank's optimizer state has the same entries, of the sizes the layout says."""
        keys = None
        for r in range(self.world):
            for g in range(groups):
                state = self._state(r, g)
                tensors = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
                keys = tensors if keys is None else keys
                if tensors != keys:
                    raise CheckpointError(f"{self.optim_files[r]}: optimizer state {sorted(tensors)} differs from "
                                          f"{sorted(keys)}")
                for k in tensors:
                    self._tensor(f"{self.optim_files[r]} state {k} of group {g}", state[k], numel_of(r, g))
                if self.stage < 3:
                    lean = self._lean[r][g]
                    self._tensor(f"{self.optim_files[r]} fp32 group {g}",
                                 self.optim[r]["single_partition_of_fp32_groups"][g], lean)
        self.state_keys = sorted(keys or ())
        self.steps = [self._step(g) for g in range(groups)]

    def _state(self, r: int, g: int) -> dict:
        state = self._base(r)["state"]
        if not state:
            return {}
        try:
            return state[self._state_index[g]]
        except KeyError:
            raise CheckpointError(f"{self.optim_files[r]}: no optimizer state for group {g}") from None

    def _step(self, g: int):
        """The step count of flat group ``g`` (the same on every rank); None before the first step."""
        values = set()
        for r in range(self.world):
            step = self._state(r, g).get("step", self.param_groups[self.params_group_of(g)].get("step"))
            if step is not None:
                values.add(float(step))
        if len(values) > 1:
            raise CheckpointError(f"{self.dir}: ranks saved different step counts {sorted(values)}")
        return values.pop() if values else None

    def params_group_of(self, flat: int) -> int:
        return next((p.param_group for p in self.params.values() if p.flat == flat), flat)

    # -------------------------------------------------------------- frozen parameters, buffers
    def _frozen(self) -> dict[str, tuple]:
        """name -> shape of the parameters DeepSpeed kept out of the optimizer."""
        shapes = self.model_states.get("frozen_param_shapes") or {}
        module = self.model_states.get("module") or {}
        out = {name: tuple(shape) for name, shape in shapes.items()}
        if self.stage < 3:  # stage 1 saves no frozen shapes: every module entry not trained, not a buffer
            buffers = set(self.model_states.get("buffer_names") or ())
            for name, t in module.items():
                if name not in self.params and name not in buffers and name not in self.shared:
                    out.setdefault(name, tuple(t.shape))
        return out

    @property
    def buffer_names(self) -> list[str]:
        return list(self.model_states.get("buffer_names") or ())

    def buffer(self, name: str) -> torch.Tensor:
        return self.model_states["module"][name]

    def client_state(self) -> dict:
        """What the user passed as ``client_state`` to DeepSpeed's ``save_checkpoint``."""
        return {k: v for k, v in self.model_states.items() if k not in _DEEPSPEED_KEYS}

    def name_of(self, names: list[str]) -> str | None:
        """The checkpoint's name for a parameter registered under ``names`` (tied: any of them)."""
        for n in names:
            n = self.shared.get(n, n)
            if n in self.params or n in self.frozen:
                return n
        return None

    def shape_of(self, name: str) -> tuple:
        return self.params[name].shape if name in self.params else self.frozen[name]

    # -------------------------------------------------------------- reading
    def _flat_tensor(self, r: int, flat: int, key: str | None) -> torch.Tensor:
        if key is None:
            groups = "single_partition_of_fp32_groups" if self.stage < 3 else "fp32_flat_groups"
            return self.optim[r][groups][flat]
        return self._state(r, flat)[key]

    def pieces(self, name: str, lo: int, hi: int):
        """(rank, offset in its flat tensor, count, offset in [lo, hi)) covering elements [lo, hi) of ``name``."""
        p = self.params[name]
        e = lo
        while e < hi:
            if self.stage < 3:
                P = self.partition[p.flat]
                flat_e = p.offset + e
                r, a = divmod(flat_e, P)
                n = min(hi - e, P - a)
                if r >= self.world or a + n > self._lean[r][p.flat]:
                    raise CheckpointError(f"{self.dir}: {name} reaches past rank {r}'s partition")
            else:
                q = math.ceil(p.numel / self.world)
                r, a = divmod(e, q)
                n = min(hi - e, q - a)
                a += p.offset
            yield r, a, n, e - lo
            e += n

    def fill(self, dst: torch.Tensor, name: str, lo: int, hi: int, key: str | None) -> None:
        """dst[0:hi-lo] <- elements [lo, hi) of trainable ``name``: the fp32 master (key None) or
        optimizer state ``key``."""
        flat = self.params[name].flat
        for r, a, n, at in self.pieces(name, lo, hi):
            dst[at:at + n].copy_(self._flat_tensor(r, flat, key)[a:a + n])

    def fill_frozen(self, dst: torch.Tensor, name: str, lo: int, hi: int) -> None:
        """dst[0:hi-lo] <- elements [lo, hi) of frozen ``name`` (compute dtype, as DeepSpeed saved it)."""
        if self.stage < 3:
            dst.copy_(self.model_states["module"][name].reshape(-1)[lo:hi])
            return
        q = math.ceil(math.prod(self.frozen[name]) / self.world)
        e = lo
        while e < hi:
            r, a = divmod(e, q)
            n = min(hi - e, q - a)
            dst[e - lo:e - lo + n].copy_(self._frozen_fragment(r, name)[a:a + n])
            e += n

    def _frozen_fragment(self, r: int, name: str) -> torch.Tensor:
        if r not in self._model_states_of:
            path = self.dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            if not path.is_file():
                raise CheckpointError(f"{path} is missing (it holds rank {r}'s part of the frozen parameters)")
            self._model_states_of[r] = safe_load(path)
        frag = (self._model_states_of[r].get("frozen_param_fragments") or {}).get(name)
        if not isinstance(frag, torch.Tensor):
            raise CheckpointError(f"rank {r}'s model-states file in {self.dir} lacks frozen {name}")
        return frag.reshape(-1)

    def load_frozen_files(self) -> None:
        """Stage 3 with frozen parameters: read (and so check) every rank's fragments now, before any copy."""
        if self.stage < 3 or not self.frozen:
            return
        for r in range(self.world):
            for name, shape in self.frozen.items():
                frag = self._frozen_fragment(r, name)
                if frag.numel() != math.ceil(math.prod(shape) / self.world):
                    raise CheckpointError(f"{self.dir}: rank {r}'s fragment of frozen {name} has {frag.numel()} "
                                          f"elements, not {math.ceil(math.prod(shape) / self.world)}")

    def close(self) -> None:
        """Drop the memory maps."""
        self.optim, self.model_states = [], {}
        self._model_states_of.clear()


def _optimizer_state(path: Path) -> dict:
    sd = safe_load(path)
    if not isinstance(sd, dict) or not isinstance(sd.get("optimizer_state_dict"), dict):
        raise CheckpointError(f"{path} is not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict)")
    return sd["optimizer_state_dict"]
