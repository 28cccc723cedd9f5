"""The training core: units, flat groups and the hooks that gather, release and reduce them.

What forward, backward, the step and setup touch: the engine's hooks (engine.py), the
stage-3 gathers and their schedule (units.py, flat.py), the gradient
buffers, ``param.grad`` markers and the step agreement (gradients.py) and their reduce
order (reduce.py), where shards rest (storage.py). It never imports _model/ (a set-up model's surface outside the step).
Layers and the import rule: docs/architecture.md.
"""
