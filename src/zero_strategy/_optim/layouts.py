"""Which layout shards an optimizer's state: flat shards, whole parameters, or none.

[Note: optimizers that need whole tensors]
``torch.optim.Muon`` orthogonalizes each gradient matrix, ``Adafactor`` keeps per-row and
per-column statistics: their update of an element depends on the whole tensor, so a
slice of a flat buffer would step them silently wrong. Their groups take the ownership
layout (See [Note: the ownership layout] in _engine/flat.py): each parameter lies whole in
one rank's master shard, and that rank's param groups hold views of its master shaped
like the parameters it owns (none on a rank that owns none), so the user's optimizer
class runs unchanged on whole tensors with the user's hyperparameters and its state is
keyed by those views. The gradient each view gets is the reduced gradient, a view of the
gradient shard; a parameter no rank has a gradient for gets none and is skipped, as with
DDP. Which optimizers need this is a table (``PER_TENSOR_OPTIMIZERS``, ``PER_TENSOR_BY_NAME`` for
other libraries' such as transformers' Adafactor, ``PER_TENSOR_LIBRARIES`` for all of
bitsandbytes': its 8-bit state is quantized in blocks of each flattened parameter), and
``ZeroConfig(optimizer_layout="owned")`` asks for it for any other. An optimizer that
reads other parameters or re-evaluates the loss (``LBFGS``'s closure and line search over
all parameters as one vector) cannot be sharded either way and is refused by name.
"""

from __future__ import annotations

import torch

#: optimizers whose update of each element depends only on that element's history
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in (
        "SGD", "Adam", "AdamW", "Adagrad", "Adamax", "RMSprop", "NAdam", "RAdam",
        "Adadelta", "ASGD", "Rprop",
    ) if hasattr(torch.optim, name)
)

#: optimizers exact on whole tensors but not on slices: stepped in the ownership layout
PER_TENSOR_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name) for name in ("Muon", "Adafactor") if hasattr(torch.optim, name))

#: per-tensor optimizers of other libraries, by (module, class name): the engine imports none of them
PER_TENSOR_BY_NAME: frozenset[tuple[str, str]] = frozenset({
    ("transformers.optimization", "Adafactor"),  # HF Trainer's optim="adafactor"
})

#: libraries whose every optimizer steps whole tensors, by module prefix (imported by none of ours):
#: bitsandbytes quantizes state block-wise over each flattened parameter (AdamW8bit's 256-element
#: blocks share one absmax), and its LAMB and LARS read the whole parameter's norm
PER_TENSOR_LIBRARIES: tuple[str, ...] = ("bitsandbytes.optim",)

#: optimizers no layout can shard, and why
UNSHARDABLE_OPTIMIZERS: dict[str, str] = {
    "LBFGS": "it needs a closure that re-evaluates the loss, and its line search treats all parameters "
             "as one vector (each rank would need every parameter and gradient)",
    "SparseAdam": "it needs sparse gradients, and sharded gradients are dense flat buffers",
}


def layout_of(optimizer: torch.optim.Optimizer, config) -> str:
    """``"flat"`` or ``"owned"``: how ``optimizer``'s state is split over ranks under ``config``, or a
    clear error where neither is exact. See [Note: optimizers that need whole tensors]."""
    _refuse_bitsandbytes_overrides(optimizer)
    name = type(optimizer).__name__
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in UNSHARDABLE_OPTIMIZERS:
            raise TypeError(f"zero_strategy cannot shard {name}: {UNSHARDABLE_OPTIMIZERS[cls.__name__]}. "
                            "Use a first-order optimizer (AdamW, SGD, Muon, Adafactor), or train without ZeRO.")
    per_tensor = isinstance(optimizer, PER_TENSOR_OPTIMIZERS) or any(
        (cls.__module__, cls.__name__) in PER_TENSOR_BY_NAME or cls.__module__.startswith(PER_TENSOR_LIBRARIES)
        for cls in type(optimizer).__mro__)
    if config.optimizer_layout == "owned" or (per_tensor and not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS)):
        return "owned"
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        return "flat"
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    whole = ", ".join(c.__name__ for c in PER_TENSOR_OPTIMIZERS)
    raise TypeError(
        f"zero_strategy cannot shard {name}: it is in neither table. Elementwise optimizers (each element's "
        f"update depends on that element alone: torch.optim.{{{names}}} or a subclass) step slices of flat "
        f"buffers; per-tensor ones (torch.optim.{{{whole}}}) step whole parameters, each owned by one rank. "
        f"If {name} reads only its own parameter's gradient and state, set "
        "ZeroConfig(optimizer_layout='owned'); if it reads other parameters, it cannot be sharded.")


def _refuse_bitsandbytes_overrides(optimizer: torch.optim.Optimizer) -> None:
    """bitsandbytes' ``GlobalOptimManager`` finds per-parameter overrides by the parameter's id or its
    (group, index) position, and both change when setup re-homes the optimizer onto views: an override
    would silently reach another parameter or none."""
    mng = getattr(optimizer, "mng", None) if type(optimizer).__module__.startswith(PER_TENSOR_LIBRARIES) else None
    if mng is not None and (getattr(mng, "index2config", None) or getattr(mng, "pid2config", None)
                            or getattr(mng, "module_weight_config_triple", None)):
        raise ValueError(
            f"zero_strategy: {type(optimizer).__name__} has per-parameter overrides in bitsandbytes' "
            "GlobalOptimManager (override_config, register_module_override, or a bnb.nn.StableEmbedding "
            "that registers one); they are found by the "
            "parameters' ids and positions, which setup changes. Give those parameters a param group of "
            "their own with the settings instead (e.g. optim_bits via a separate optimizer)")
