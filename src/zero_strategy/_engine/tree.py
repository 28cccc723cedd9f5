"""Tensors inside the nested containers modules take and return (tuples, lists, dicts, HF ModelOutput)."""

from __future__ import annotations

from typing import Any

import torch


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Tensors inside nested tuples/lists/dicts (including Hugging Face ModelOutput)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


def map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(x, fn) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj
