"""``model.state_dict()`` on a set-up model, as on a plain one.

Without these hooks torch's own method sees the engine's storage, not the model: at
stage 3 a released parameter holds no values, so ``state_dict()`` returned empty tensors
(and ``save_pretrained`` wrote them to disk without a word). Module state-dict hooks
route the call through the engine.

[Note: state dict calls are collectives]
At stage 3 ``state_dict()`` all-gathers the units it touches, so every rank must make
the same calls in the same order, as with any collective.
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
someone else). One copy per viewed tensor: tied parameters (one object under two
names, HF's ``lm_head``/``embed_tokens``) come out as one tensor under both names, as on
a plain model, which ``save_pretrained`` relies on to drop the duplicate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ._flat import ShardState
from ._units import Unit

if TYPE_CHECKING:  # the engine imports this module
    from ._state import ZeroEngine


class _Call:
    """What one ``state_dict()`` or ``load_state_dict()`` call has done so far."""

    def __init__(self, owner: nn.Module):
        self.owner = owner
        #: id(unit) -> (unit, the module whose post-hook releases it; None: the call's end)
        self.ours: dict[int, tuple[Unit, nn.Module | None]] = {}

    def releasing_at(self, module: nn.Module) -> list[Unit]:
        if module is self.owner:
            return [u for u, _ in self.ours.values()]
        return [u for u, releaser in self.ours.values() if releaser is module]


class ModuleStateHooks:
    """The module state-dict hooks of one engine; see the Notes above."""

    def __init__(self, engine: "ZeroEngine"):
        self.engine = engine
        self._save: _Call | None = None
        self._load: _Call | None = None
        self._unit_of_module = {id(u.module): u for u in engine.units if u.sharded_groups}
        self._sharded_unit_of = {id(s.param): u for u in engine.units for g in u.sharded_groups for s in g.slots}
        self._managed = {id(s.param) for g in engine.groups for s in g.slots}

    def register(self) -> list:
        """Hooks on every module holding managed parameters; returns their handles."""
        managed = self._managed
        after_save = lambda m, sd, prefix, meta: self.after_save(m, sd, prefix)  # noqa: E731
        handles = []
        if not self._sharded_unit_of:
            return handles  # stages 1-2, or nothing sharded: state_dict() is right as it is
        for m in self.engine.model.modules():
            if not any(id(p) in managed for p in m.parameters()):
                continue
            handles.append(m.register_state_dict_pre_hook(self.before_save))
            handles.append(m.register_state_dict_post_hook(after_save))
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
            call = self._save = _Call(module)
        self._gather_for(call, module)

    def after_save(self, module: nn.Module, destination: dict, prefix: str) -> None:
        call = self._save
        if call is None:
            return
        units = call.releasing_at(module)
        if module is call.owner:
            self._save = None
            # see [Note: state_dict entries are copies]: also units gathered by someone else
            viewed = [u for u in self.engine.units if u.sharded_groups and u.state is ShardState.GATHERED]
            self._copy_entries_viewing(destination, prefix, viewed)
        elif units:
            self._copy_entries_viewing(destination, prefix, units)
        self._release(call, units)

    @staticmethod
    def _copy_entries_viewing(destination: dict, prefix: str, units: list[Unit]) -> None:
        """Replace the entries under ``prefix`` that view these (gathered) units' storage by copies.

        Views are told apart by address, so the table lives only while those storages do: a
        unit gathered later may get a freed unit's addresses.
        """
        storages = {s.param.untyped_storage().data_ptr()
                    for u in units for g in u.sharded_groups for s in g.slots[:1]}
        storages.discard(0)
        copies: dict[tuple, torch.Tensor] = {}  # (storage, offset, shape, stride, dtype) -> copy
        for key, t in list(destination.items()):
            if not (key.startswith(prefix) and isinstance(t, torch.Tensor)) or t.is_meta:
                continue
            try:
                ptr = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
                continue
            if ptr in storages:
                view = (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
                if view not in copies:
                    copies[view] = t.clone()
                destination[key] = copies[view]

def register_module_state_hooks(engine: "ZeroEngine") -> list:
    """Route ``state_dict`` / ``load_state_dict`` of ``engine.model`` and its submodules
    through the engine; returns the hook handles (removed with the engine's other hooks)."""
    return ModuleStateHooks(engine).register()

