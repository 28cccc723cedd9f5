"""The one installer: everything ``setup`` puts on the user's model, and the one undo list teardown runs.

Three kinds of thing go onto a set-up model, each so that the user's own calls keep working:
the module state-dict hooks (``model.state_dict()`` / ``load_state_dict()`` see full weights
and reach the shards and masters: _model/state_dict.py), the ``_apply`` shadow on every module
(``.cpu()``, ``.to()``, ``.half()``: _model/conversions.py) and the shadows of transformers'
and PEFT's methods (``generate``, ``save_pretrained``, the merges: _model/hf.py; a causal LM's
``forward`` when the config asks for the tiled loss: _model/tiled_loss.py; a gated MLP's for the
tiled MLP: _model/tiled_mlp.py), and the pre-hooks that
offload checkpointed layers' inputs (_model/activation_offload.py). They are put
on here and nowhere else, and :func:`install` returns the callbacks that take each off again:
``engine.undo_on_teardown``, which ``zero_strategy.teardown`` runs after the engine's own
hooks are removed. The engine never sees any of it: it imports nothing of _model/.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

from torch import nn

from .activation_offload import checkpoint_offload_hooks
from .conversions import apply_shadows
from .hf import library_shadows, tiled_loss_shadows
from .quantized import keep_packed_layout
from .state_dict import register_module_state_hooks
from .tiled_mlp import tiled_mlp_shadows

if TYPE_CHECKING:
    from .._engine.engine import ZeroEngine


def install(model: nn.Module, engine: "ZeroEngine", end: Callable[[], None]) -> list[Callable[[], None]]:
    """Put the state-dict hooks, the library shadows and the ``_apply`` shadows on ``model``;
    ``end()`` tears the engine down (a conversion that asks for the trained weights calls it).
    Returns the undo callbacks, in the order they were put on."""
    undo: list[Callable[[], None]] = [h.remove for h in register_module_state_hooks(engine)]
    # See [Note: conversions on a set-up model] in _model/conversions.py
    shadows = (tiled_loss_shadows(model, engine) + tiled_mlp_shadows(model, engine.config.tiled_mlp)
               + library_shadows(model, engine) + apply_shadows(model, engine, end))
    for module, name, make in shadows:
        undo.append(shadow(module, name, make))
    # See [Note: packed 4-bit parameters under ZeRO] in _model/quantized.py
    undo.extend(keep_packed_layout(model, {id(s.param) for g in engine.groups for s in g.slots}))
    if engine.config.activation_offload:  # See [Note: activation offload] in _model/activation_offload.py
        undo.extend(checkpoint_offload_hooks(model))
    return undo


def shadow(module: nn.Module, name: str, make: Callable) -> Callable[[], None]:
    """Shadow ``module.<name>`` by ``make(original)`` (an instance attribute: the class and other
    models are untouched); the returned callback removes it."""
    original = getattr(module, name)
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    module.__dict__[name] = wrapper

    def remove() -> None:
        if module.__dict__.get(name) is wrapper:
            del module.__dict__[name]
    return remove
