"""The training core: units, flat groups and the hooks that gather, release and reduce them.

What forward, backward, the step and setup touch: the engine's hooks (engine.py), the
stage-3 gathers and their schedule (units.py, group_gathers.py, flat.py), the gradient
reduce (grads.py, reduce.py), the step agreement (untouched.py), where shards rest
(storage.py). It never imports _model/ (a set-up model's surface outside the step).
Layers and the import rule: docs/architecture.md.
"""
