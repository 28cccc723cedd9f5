"""The tiled MLP: a decoder layer's MLP run over chunks of the sequence, recomputed in backward.

[Note: the tiled MLP]
A gated MLP (Llama's ``down(act(gate(x)) * up(x))``) keeps for backward its gate and up outputs,
the activation and the product, 4e·s·b·f bytes per layer with f the MLP width (3.5x the hidden
size in Llama 3): at 32K tokens of an 8B Llama, 3.7 GiB per layer in bf16, the largest term of
the one layer a checkpointed model recomputes at a time. The MLP treats each token on its own,
so it can run over chunks of the sequence: :class:`TiledMLPFunction` runs the module's forward
chunk by chunk without autograd and saves only its input; backward runs each chunk again with
autograd on and takes that chunk's gradients with ``torch.autograd.grad``, so what it holds is
one chunk's intermediates. The module runs through ``torch.func.functional_call`` with its
parameters detached: the gradients of the parameters are summed over the chunks here and handed
to autograd once, as the Function's own input gradients, so every hook on a parameter (the
engine's gradient hooks, a user's) fires once per backward, with the whole gradient, as without
tiling. The result is the untiled MLP's to rounding (each token's arithmetic is the same; a
parameter's gradient is summed over chunks in fp32).

``ZeroConfig(tiled_mlp=...)`` shadows ``forward`` of each gated MLP (a module with ``gate_proj``,
``up_proj`` and ``down_proj`` linear children) of a Hugging Face model in training: _model/install.py
puts the shadows on, teardown takes them off. Only where it pays: at long sequences with the MLP
wider than the hidden size.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call


class TiledMLPFunction(torch.autograd.Function):
    """``module(x)`` over chunks of ``chunk`` tokens (dimension -2), recomputed in backward.
    See [Note: the tiled MLP]. x: (..., s, h); params: the module's parameters, in ``names`` order."""

    @staticmethod
    def forward(ctx, module: nn.Module, names: tuple[str, ...], chunk: int, x: torch.Tensor, *params):
        ctx.module, ctx.names, ctx.chunk = module, names, chunk
        ctx.save_for_backward(x, *params)
        values = dict(zip(names, params))
        return torch.cat([functional_call(module, values, (part,)) for part in x.split(chunk, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, *params = ctx.saved_tensors
        needs_x = ctx.needs_input_grad[3]
        needs = ctx.needs_input_grad[4:]
        leaves = [p.detach().requires_grad_(need) for p, need in zip(params, needs)]
        values = dict(zip(ctx.names, leaves))
        grad_x = torch.empty_like(x) if needs_x else None
        sums = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) if need else None
                for p, need in zip(params, needs)]
        start = 0
        with torch.enable_grad():
            for part, grad_part in zip(x.split(ctx.chunk, dim=-2), grad_out.split(ctx.chunk, dim=-2)):
                width = part.shape[-2]
                part = part.detach().requires_grad_(needs_x)
                out = functional_call(ctx.module, values, (part,))
                wanted = ([part] if needs_x else []) + [leaf for leaf, need in zip(leaves, needs) if need]
                grads = iter(torch.autograd.grad(out, wanted, grad_part, allow_unused=True))
                if needs_x:
                    grad_x.narrow(-2, start, width).copy_(next(grads))
                for k, need in enumerate(needs):
                    if need:
                        g = next(grads)
                        if g is not None:
                            sums[k] += g
                start += width
        grad_params = [None if s is None else s.to(p.dtype) for s, p in zip(sums, params)]
        return (None, None, None, grad_x, *grad_params)


def is_gated_mlp(module: nn.Module) -> bool:
    """A Llama-style gated MLP: ``gate_proj``, ``up_proj`` and ``down_proj`` linear children."""
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))


def tiled_mlp_forward(module: nn.Module, chunk: int) -> Callable[[Callable], Callable]:
    """``make(original) -> forward`` for _model/install.py: ``module``'s forward over chunks of ``chunk``
    tokens in training with autograd on, its own forward otherwise."""
    module_ref = weakref.ref(module)

    def make(original: Callable) -> Callable:
        def forward(x: torch.Tensor, *args, **kwargs):
            mlp = module_ref()
            if (mlp is None or args or kwargs or not mlp.training or not torch.is_grad_enabled()
                    or x.dim() < 2 or x.shape[-2] <= chunk):
                return original(x, *args, **kwargs)
            names = tuple(name for name, _ in mlp.named_parameters())
            params = [p for _, p in mlp.named_parameters()]
            return TiledMLPFunction.apply(mlp, names, chunk, x, *params)
        return forward
    return make


def tiled_mlp_targets(model: nn.Module, tiled: bool | int) -> list[tuple[nn.Module, int]]:
    """(gated MLP, chunk tokens) for ``ZeroConfig(tiled_mlp=tiled)``: ``True`` takes as many tokens a
    chunk as the hidden size (ALST's rule); a model with no gated MLP is refused."""
    if tiled is False:
        return []
    mlps = [m for m in model.modules() if is_gated_mlp(m)]
    if not mlps:
        raise ValueError(f"zero_strategy: tiled_mlp is set but {type(model).__name__} has no gated MLP (a module "
                         "with gate_proj, up_proj and down_proj linears) to tile. Drop tiled_mlp.")
    return [(m, m.gate_proj.in_features if tiled is True else tiled) for m in mlps]


def tiled_mlp_shadows(model: nn.Module, tiled: bool | int) -> list[tuple[nn.Module, str, Callable]]:
    """The ``forward`` shadows _model/install.py puts on each gated MLP. See [Note: the tiled MLP]."""
    return [(mlp, "forward", tiled_mlp_forward(mlp, chunk)) for mlp, chunk in tiled_mlp_targets(model, tiled)]
