"""The engine: units, flat groups and the hooks that gather, release and reduce them.

What forward and backward touch: the engine's hooks (engine.py), the stage-3 gathers
(units.py, flat.py, schedule.py), the gradient reduce (grads.py, reduce.py), where
shards rest (storage.py). Layers and the import rule: docs/architecture.md.
"""
