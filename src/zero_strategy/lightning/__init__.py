"""PyTorch Lightning front end: ``Trainer(strategy="zero3")`` and ``Fabric(strategy="zero3")``.

``import zero_strategy`` registers the presets ``zero1``, ``zero2``, ``zero2_offload``,
``zero3``, ``zero3_offload`` and ``zero3_offload_nvme`` in Lightning's Trainer and
Fabric strategy registries (lazily; see ``_registry.py``). For custom settings:
``Trainer(strategy=zero_strategy.ZeroStrategy(stage=2, offload_optimizer="cpu"))``.

The classes are loaded on first access, so importing this package (which
``import zero_strategy`` does, for the registration) does not import Lightning.
"""

from importlib import import_module

from ._registry import register_if_available, register_presets

_LAZY = {
    "ZeroStrategy": "._strategy",
    "ZeroFabricStrategy": "._fabric",
    "ZeroPrecision": "._precision",
    "ZeroFabricPrecision": "._precision",
    "ZeroModelSummary": "._summary",
    "convert_to_lightning_checkpoint": "._checkpoint",
    "read_lightning_state": "._checkpoint",
    # run a LightningModule method (evaluation, generate) through the module's forward hooks
    "call_through_hooks": "._strategy",
}

__all__ = [*_LAZY, "register_if_available", "register_presets"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
