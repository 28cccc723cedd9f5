"""The configuration layer's internals: policy objects, value checks, the DeepSpeed translation.

``zero_strategy.config`` (public) builds on these; nothing here knows about tensors
being sharded. Layers and the import rule: docs/architecture.md.
"""
