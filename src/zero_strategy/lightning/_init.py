"""Building the model on the meta device inside ``configure_model`` / ``fabric.init_module``.

Under stage 3 the strategies create the model on the meta device by default
(``meta_init=None``: stage 3 only; ``True`` / ``False`` to force), so no rank ever
holds the whole model: ``zero_strategy.setup`` materializes, initializes (each
module's ``reset_parameters()``, or the strategy's ``param_init_fn``), broadcasts and
shards it one unit at a time. Parameters keep their identity, so optimizers built
over the meta parameters in ``configure_optimizers`` stay valid. A meta parameter
or buffer that nothing initializes is an error naming it (the engine's rule).
"""

from __future__ import annotations

import contextlib

import torch


def meta_init_enabled(meta_init, stage: int) -> bool:
    return stage == 3 if meta_init is None else bool(meta_init)


@contextlib.contextmanager
def meta_init_context(enabled: bool):
    if not enabled:
        yield
        return
    with torch.device("meta"):
        yield


def has_meta_tensors(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))
