"""A set-up model's surface: what a model does outside the training step.

Whole-model gathers and state dicts (gather.py, state_dict.py), streamed saves (saves.py,
hf.py), generation (generation.py), offload phases (offload_states.py), conversions
(conversions.py), the memory report (memory.py), and the one installer that puts all of it
on the user's model (install.py). It imports _engine/ freely and is never imported by it.
Layers and the import rule: docs/architecture.md.
"""
