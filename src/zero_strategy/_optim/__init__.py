"""The optimizer step: the user's optimizer re-homed onto fp32 master shards.

``optimizer.py`` (ZeroOptimizer: loss scale, clipping, the device step) and
``offloaded_step.py`` (the host-side step pipeline). Layers and the import rule:
docs/architecture.md.
"""
