"""Module conversions (``.cpu()``, ``.to(...)``, ``.half()``, ...) and freezing on a set-up model.

[Note: conversions on a set-up model]
torch's conversions all go through ``Module._apply(fn)``, which replaces each parameter's
data and gradient by ``fn`` of it. On a set-up model the parameters are views of flat
buffers (stage 3: placeholders at rest), their gradients live in shards (``param.grad``
is a marker that refuses conversions) and the fp32 masters and optimizer state were
placed at setup, so no conversion can move or cast them in place. ``setup`` shadows
``_apply`` on every module of the model with an instance attribute (removed by
``teardown``; applied by _model/install.py, as the transformers/PEFT shadows of _model/hf.py):

* a conversion that leaves the parameters as they are (``.to(its device)``, which
  Lightning, Accelerate and the HF Trainer call after setup, ``.float()`` of an fp32
  model, ``model.cpu()`` of a model on the CPU at stages 1-2, where every rank holds the
  trained weights anyway) converts the buffers and any parameter the engine does not
  hold, and training goes on unchanged;
* any other conversion of the whole model (``model.cpu()`` after training on a GPU, or
  at stage 3 on any device, the explicit ask for the trained weights; ``.half()``
  before saving; ``.to(torch.float64)``) ends ZeRO on it: ``teardown``
  gathers the trained weights into the plain module (a collective at stage 3, so every
  rank makes the call, as with ``state_dict()``), then torch's own conversion runs. The
  model is a plain module again, its ZeroOptimizer refuses to step (set it up again to
  train on), and a conversion torch refuses (``.cuda()`` without a GPU) is refused
  before anything is gathered;
* converting part of a set-up model (``model.layers[0].half()``) cannot be followed
  and raises with the fix.

``.train()``/``.eval()`` change flags only and ``requires_grad_(False)`` behaves as on a
plain model (a parameter that gets no gradient is not stepped: See [Note: no gradient
on any rank] in _engine/gradients.py). ``requires_grad_(True)`` on a parameter that was frozen
at setup cannot train it (the engine holds no gradient buffer, master or optimizer
state for it): ``unfrozen_error`` (_engine/gradients.py) is raised at the next step on every rank (the step agreement
carries whether any rank has such a gradient), naming it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

if TYPE_CHECKING:
    from .._engine.engine import ZeroEngine


def apply_shadows(model: nn.Module, engine: "ZeroEngine", end: Callable[[], None]
                  ) -> list[tuple[nn.Module, str, Callable]]:
    """The ``_apply`` shadow of every module of ``model`` as (module, "_apply", ``make(original)``),
    for _model/install.py to apply; ``end()`` tears the engine down."""
    managed = engine.managed.keys()
    return [(module, "_apply", functools.partial(_converter, module, model, engine, managed, end))
            for module in model.modules()]


def _converter(module: nn.Module, root: nn.Module, engine: "ZeroEngine", managed,
               end: Callable[[], None], original: Callable) -> Callable:
    def _apply(fn, recurse: bool = True):
        probe = torch.empty(0, dtype=engine.compute_dtype, device=engine.device)
        converted = fn(probe)  # raises here, before anything changed, if torch refuses the conversion
        unchanged = converted.dtype == probe.dtype and converted.device == probe.device
        if unchanged and not (module is root and _asks_for_the_weights(fn) and engine.plan.shards_parameters):
            _convert_the_rest(module, fn, managed, recurse)
            return module
        if module is not root:
            raise RuntimeError(
                f"zero_strategy: cannot convert the submodule {type(module).__name__} of a set-up model to "
                f"{converted.dtype} on {converted.device}: its parameters are views of flat shards shared "
                "with the rest of the model. Convert the whole model (model.cpu(), model.half(), ...: this "
                "gathers the trained weights into the plain module and ends ZeRO on it), or call "
                "zero_strategy.teardown(model) first.")
        engine.ended = (f"a conversion of the model (model.cpu(), .to(), .half(), ...) to {converted.dtype} on "
                        f"{converted.device} gathered its trained weights into the plain module")
        end()  # removes this shadow too
        return original(fn, recurse)  # torch's own, now that the model is plain
    return _apply


def _asks_for_the_weights(fn) -> bool:
    """``fn`` is the one of ``Module.cpu()``: the user wants the trained weights on the CPU."""
    return getattr(fn, "__qualname__", "").startswith("Module.cpu.")


def _convert_the_rest(module: nn.Module, fn, managed, recurse: bool) -> None:
    """``fn`` on the buffers and the parameters the engine does not hold, as torch would."""
    with torch.no_grad():
        for m in module.modules() if recurse else [module]:
            for key, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[key] = fn(buf)
            for p in m._parameters.values():
                if p is not None and id(p) not in managed:
                    p.data = fn(p.data)
                    if p.grad is not None:
                        p.grad = fn(p.grad)
