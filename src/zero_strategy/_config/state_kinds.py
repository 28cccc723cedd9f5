"""The kinds of engine state ``offload_states`` moves, by DeepSpeed's names and ours.

DeepSpeed's ``OffloadStateTypeEnum`` names five kinds; a ``str`` enum member, its value
or one of our memory-report words is accepted wherever a kind is (``include=``, the
config's ``offload_states_during_generation``). Kept free of torch so the config layer
can validate with it.
"""

from __future__ import annotations

from typing import Any, Iterable

#: DeepSpeed's names, in the order states are moved (one storage is moved once, under the
#: first kind that names it: see [Note: what offload_states moves] in _model/offload_states.py)
KINDS: tuple[str, ...] = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")

#: our words (memory_report categories and plain names) -> the DeepSpeed kinds they mean
_OUR_NAMES: dict[str, tuple[str, ...]] = {
    "optimizer_state": ("optim_states",), "optimizer_states": ("optim_states",),
    "master": ("hp_params",), "masters": ("hp_params",),
    "params": ("lp_params",), "parameters": ("lp_params",),
    "grads": ("lp_grads", "contiguous_grad_buffer"), "gradients": ("lp_grads", "contiguous_grad_buffer"),
}

#: everything a training step needs that generation does not: the default of
#: ``offload_states_during_generation=True``
TRAINING_ONLY: tuple[str, ...] = ("optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer")


def parse_kinds(include: Any, where: str) -> tuple[str, ...]:
    """``include`` (None: every kind; one name or an iterable of names / enum members) as
    DeepSpeed kind names in :data:`KINDS` order. ``where`` names the caller in errors."""
    if include is None:
        return KINDS
    items: Iterable[Any] = [include] if isinstance(include, str) else include
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"{where}: expected a kind name or a list of them, got {include!r}; "
                        f"kinds: {', '.join(KINDS)}") from None
    chosen: set[str] = set()
    for item in items:
        name = getattr(item, "value", item)  # DeepSpeed's OffloadStateTypeEnum members
        if not isinstance(name, str):
            raise TypeError(f"{where}: {item!r} is not a state kind; kinds: {', '.join(KINDS)}")
        key = name.strip().lower()
        if key in KINDS:
            chosen.add(key)
        elif key in _OUR_NAMES:
            chosen.update(_OUR_NAMES[key])
        else:
            raise ValueError(
                f"{where}: unknown state kind {name!r}. Kinds: {', '.join(KINDS)} (DeepSpeed's "
                f"OffloadStateTypeEnum), or {', '.join(sorted(_OUR_NAMES))}")
    return tuple(k for k in KINDS if k in chosen)
