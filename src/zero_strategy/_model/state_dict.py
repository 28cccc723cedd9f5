"""``model.state_dict()`` and ``model.load_state_dict(sd)`` on a set-up model, as on a plain one.

Without these hooks torch's own methods see the engine's storage, not the model: at
stage 3 a released parameter holds no values, so ``state_dict()`` returned its
placeholder (an empty tensor once, a NaN one now) and ``save_pretrained`` wrote it to
disk without a word, and ``load_state_dict``
wrote only the compute-dtype parameters, which the next ``optimizer.step()`` overwrote
from the fp32 masters. Module state-dict hooks route both calls through the engine;
writes reach the shards and masters through ``FlatGroup.write_back_gathered``, the one
write-back ``gathered_parameters(modifier_rank=...)`` uses too.

[Note: state dict calls are collectives]
At stage 3 ``state_dict()`` and ``load_state_dict()`` all-gather the units they touch,
so every rank must make the same calls in the same order, as with any collective.
``save_pretrained`` calls ``state_dict()`` on every rank before it looks at
``is_main_process``, so it too is called on every rank. Stages 1-2, persistent groups,
``keep_vars=True`` and calls while the units are gathered anyway (inside forward or
``gathered_parameters``) communicate nothing.

[Note: one call, many hooks]
torch runs the hooks of every module of the tree, pre-hooks top-down and post-hooks
bottom-up. The module whose pre-hook finds no call in progress *owns* the call, which
ends in the owner's post-hook (a module is never its own descendant; a pre-hook of the
owner while its call is open means that call died half way, and it is closed first).
Each unit is gathered at most once per call: a unit's own module gathers the whole unit
in its pre-hook and releases it in its post-hook, when every entry below it is in, so a
``model.state_dict()`` holds the root unit and one block at a time. A unit reached below
its module (``block.fc1.state_dict()``), or the root unit through a leaf, is gathered at
first need and released when the call ends. A unit that was already gathered (forward,
``gathered_parameters``) is left gathered. Released or not is asked of the unit
(``Unit.state``), never of a parameter's shape.

[Note: state_dict entries are copies]
On a plain model an entry is ``param.detach()``, a view of the live parameter. A
sharded parameter's storage is freed at release, so entries that view it are replaced
by copies before any release (and at the end of the call, for units gathered by
someone else). The copies are made in host memory, unit by unit, right before the
unit is released: the compute device never holds more than the units being visited
(the root unit and one block) beyond its shards, however big the model, as
``full_state_dict`` does. At the end of the call every other entry under the call's
module (persistent parameters, buffers) is copied to the host too, so a stage-3
``state_dict()`` is on the host as a whole, not split over two devices. One copy per
viewed tensor: tied parameters (one object under two names, HF's
``lm_head``/``embed_tokens``) come out as one tensor under both names, as on a plain
model, which ``save_pretrained`` relies on to drop the duplicate.

[Note: load_state_dict keeps the fp32 masters exact]
torch's copy writes each value into the compute-dtype parameter (a view of the gathered
full buffer). When the unit is released or the call ends, ``write_back_gathered`` puts
this rank's slice of the full buffer into the resting shard, and the masters of just
the parameters loaded take the state dict's own values: a bf16 model loading an fp32
state dict keeps fp32 masters (as a mixed-precision model that loads into its fp32
copy does), and a parameter the state dict lacks (``strict=False``) keeps its master
instead of a bf16 rounding of it. The value a parameter got is read from torch's own
dict when it is stored (torch copies from that dict after our pre-hook and after any
hook registered later); for a tied parameter the last of its names wins, as in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from .._engine.engine import refuse_while_offloaded
from .._engine.flat import FlatGroup, ShardState
from .._engine.units import Unit

if TYPE_CHECKING:
    from .._engine.engine import ZeroEngine


class _Call:
    """What one ``state_dict()`` or ``load_state_dict()`` call has done so far."""

    def __init__(self, owner: nn.Module):
        self.owner = owner
        #: id(unit) -> (unit, the module whose post-hook releases it; None: the call's end)
        self.ours: dict[int, tuple[Unit, nn.Module | None]] = {}
        #: load_state_dict: id(param) -> (its group, torch's dict for its module, its key)
        self.loaded: dict[int, tuple[FlatGroup, Mapping[str, Any], str]] = {}
        #: state_dict: the keys already replaced by host copies (See [Note: state_dict entries are copies])
        self.copied: set[str] = set()

    def releasing_at(self, module: nn.Module) -> list[Unit]:
        if module is self.owner:
            return [u for u, _ in self.ours.values()]
        return [u for u, releaser in self.ours.values() if releaser is module]


class ModuleStateHooks:
    """The four module state-dict hooks of one engine; see the Notes above."""

    def __init__(self, engine: "ZeroEngine"):
        self.engine = engine
        self._save: _Call | None = None
        self._load: _Call | None = None
        self._unit_of_module = {id(u.module): u for u in engine.units if u.sharded_groups}
        self._sharded_unit_of = {id(s.param): u for u in engine.units for g in u.sharded_groups for s in g.slots}

    def register(self) -> list:
        """Hooks on every module holding managed parameters; returns their handles."""
        managed = self.engine.managed
        after_save = lambda m, sd, prefix, meta: self.after_save(m, sd, prefix)  # noqa: E731
        handles = []
        for m in self.engine.model.modules():
            if not any(id(p) in managed for p in m.parameters()):
                continue
            if self._sharded_unit_of:  # stage 3: something is ever released (stages 1-2 are right as is)
                handles.append(m.register_state_dict_pre_hook(self.before_save))
                handles.append(m.register_state_dict_post_hook(after_save))
            handles.append(m.register_load_state_dict_pre_hook(self.before_load))
            handles.append(m.register_load_state_dict_post_hook(self.after_load))
        return handles

    # -------------------------------------------------------------- gathering
    def _gather_for(self, call: _Call, module: nn.Module) -> None:
        """The unit this module is the root of, and the units of its own parameters."""
        unit = self._unit_of_module.get(id(module))
        if unit is not None:
            self._gather(call, unit, releaser=module)
        for p in module.parameters(recurse=False):
            unit = self._sharded_unit_of.get(id(p))
            if unit is not None:
                self._gather(call, unit, releaser=None)

    def _gather(self, call: _Call, unit: Unit, releaser: nn.Module | None) -> None:
        if id(unit) in call.ours:
            return
        if unit.gather_in_flight:  # a prefetch someone else started (and will release)
            unit.wait_gather()
        if unit.state is ShardState.SHARDED:
            unit.gather(self.engine.comm)
            call.ours[id(unit)] = (unit, releaser)

    def _release(self, call: _Call, units: list[Unit]) -> None:
        for u in units:
            u.release()
            call.ours.pop(id(u), None)

    # ------------------------------------------------------------ state_dict
    def before_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if keep_vars:
            return  # the caller wants the parameters themselves (full_state_dict, checkpoints)
        call = self._save
        if call is None or module is call.owner:
            if call is not None:  # the last call died half way: its entries are gone with it
                self._release(call, call.releasing_at(call.owner))
            if self.engine.offloaded is not None and self._sharded_unit_of:  # stage 3 would gather
                refuse_while_offloaded(self.engine.offloaded, "model.state_dict()", ("lp_params",))
            call = self._save = _Call(module)
            self.engine.comm.enter("state_dict")  # see [Note: bounded waits] in _comm/collectives.py
        self._gather_for(call, module)

    def after_save(self, module: nn.Module, destination: dict, prefix: str) -> None:
        call = self._save
        if call is None:
            return
        units = call.releasing_at(module)
        if module is call.owner:
            self._save = None
            # see [Note: state_dict entries are copies]: also units gathered by someone else, then the rest
            self._copy_to_host(call, destination, prefix, None)
        elif units:
            self._copy_to_host(call, destination, prefix, units)
        self._release(call, units)

    @staticmethod
    def _copy_to_host(call: _Call, destination: dict, prefix: str, units: list[Unit] | None) -> None:
        """Replace the entries under ``prefix`` that view these (gathered) units' storage by host
        copies (``units=None``: every entry not copied yet). See [Note: state_dict entries are copies].

        Views are told apart by address, so the table of copies lives only while those storages
        do: a unit gathered later may get a freed unit's addresses.
        """
        storages = None if units is None else {
            s.param.untyped_storage().data_ptr() for u in units for g in u.sharded_groups for s in g.slots[:1]}
        copies: dict[tuple, torch.Tensor] = {}  # (storage, offset, shape, stride, dtype) -> copy
        for key, t in list(destination.items()):
            if key in call.copied or not (key.startswith(prefix) and isinstance(t, torch.Tensor)) or t.is_meta:
                continue
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
                continue
            if storages is None or (ptr and ptr in storages):
                view = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
                if view not in copies:
                    copies[view] = t.detach().to("cpu", copy=True)
                destination[key] = copies[view]
                call.copied.add(key)

    # ------------------------------------------------------- load_state_dict
    def before_load(self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                    strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        call = self._load
        if call is None or module is call.owner:
            if call is not None:  # the last call died half way: keep what it loaded, as torch does
                self._store_loaded(call, None)
                self._release(call, call.releasing_at(call.owner))
            _refuse_replacing_parameters(module, local_metadata)
            if self.engine.offloaded is not None:
                refuse_while_offloaded(self.engine.offloaded, "model.load_state_dict()", ("lp_params", "hp_params"))
            call = self._load = _Call(module)
            if self._sharded_unit_of:
                self.engine.comm.enter("load_state_dict")
        self._gather_for(call, module)
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            key = prefix + name
            group = self.engine.group_of(p)
            if group is not None and key in state_dict:
                call.loaded[id(p)] = (group, state_dict, key)  # pre-order, as torch copies: last wins

    def after_load(self, module: nn.Module, incompatible_keys) -> None:
        call = self._load
        if call is None:
            return
        units = call.releasing_at(module)
        if module is call.owner:
            self._load = None
            self._store_loaded(call, None)
        elif units:
            self._store_loaded(call, units)
        self._release(call, units)

    def _store_loaded(self, call: _Call, units: list[Unit] | None) -> None:
        """``FlatGroup.write_back_gathered`` for the groups loaded into (of ``units``; None: all)."""
        unit_ids = None if units is None else {id(u) for u in units}
        touched: dict[int, tuple[FlatGroup, dict[int, torch.Tensor]]] = {}
        for pid, (group, sd, key) in list(call.loaded.items()):
            if unit_ids is not None and id(self.engine.unit_of(group)) not in unit_ids:
                continue
            del call.loaded[pid]
            values = touched.setdefault(id(group), (group, {}))[1]
            value = sd.get(key)
            if _loads_as(value, self.engine.managed[pid][1].shape):
                values[pid] = value.detach()
        for group, values in touched.values():
            unit = self.engine.unit_of(group)
            if group in unit.sharded_groups and unit.state is ShardState.SHARDED:
                continue  # released since (only after a call that died half way): nothing to keep
            group.write_back_gathered(values)


def _loads_as(value: Any, shape: torch.Size) -> bool:
    """Whether torch's ``_load_from_state_dict`` copies ``value`` into a parameter of ``shape``
    (otherwise it reported an error and the parameter kept its value)."""
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return False
    return value.shape == shape or (len(shape) == 0 and tuple(value.shape) == (1,))


def _refuse_replacing_parameters(module: nn.Module, local_metadata: dict) -> None:
    """``assign=True`` and swap-tensors loading replace the parameters' storage, which after
    setup is the engine's flat buffer: refuse before anything is gathered or copied."""
    if local_metadata.get("assign_to_params_buffers", False):
        how = "load_state_dict(..., assign=True)"
    elif torch.__future__.get_swap_module_params_on_conversion():
        how = "load_state_dict under torch.__future__.set_swap_module_params_on_conversion(True)"
    else:
        return
    raise ValueError(
        f"zero_strategy: {how} would replace the parameters of {type(module).__name__}, which after setup "
        "are views into the engine's shards; call load_state_dict without it (values are copied into "
        "the shards and masters), or zs.load_full_state_dict(model, state_dict)")


def register_module_state_hooks(engine: "ZeroEngine") -> list:
    """Route ``state_dict`` / ``load_state_dict`` of ``engine.model`` and its submodules
    through the engine; returns the hook handles (_model/install.py removes them at teardown)."""
    return ModuleStateHooks(engine).register()

