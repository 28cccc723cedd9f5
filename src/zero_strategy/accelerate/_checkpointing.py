"""``save_state`` / ``load_state`` for a ZeroAccelerator: Accelerate's files plus our sharded checkpoints.

[Note: who writes what]
Accelerate's own ``save_state`` writes what it knows how to write: the models and
optimizers that are *not* ZeRO-sharded, the schedulers, the data-loader samplers,
the RNG state of every process, the step counter, the GradScaler and the objects
registered with ``register_for_checkpointing``. It would also write each ZeRO
model's ``state_dict`` and rank 0's optimizer shard only, which loses the other
ranks' shards; so while it runs, the ZeRO models and their optimizers are taken out
of its lists (and put back, also on an error). Each ZeRO model with its optimizers
is then saved by :func:`zero_strategy.save_checkpoint` into ``zero_model`` (the
second one ``zero_model_1``, ...) inside the same directory: every rank writes its
own shard, and loading re-shards by parameter name, so ``load_state`` works on any
number of processes and any stage. ``zero_strategy_accelerate.json`` records the
step counter and the number of processes (Accelerate keeps its step only in each
rank's RNG file, which a rank that did not exist at save time lacks).

Hooks registered with ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``
see the non-ZeRO models only.

[Note: total_limit deletes after the commit]
With ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=K)`` Accelerate's
``save_state`` deletes the oldest ``checkpoint_<i>`` folders *before* it writes the new one, so that
K remain with it. Before a synchronous save that already leaves K-1 (none with K=1) should the save
fail; before an asynchronous one it is worse: the previous save may still be writing, and its
folder (K=1) or the one before it is deleted under it, so a failure of either write can leave no
loadable checkpoint at all. Here the same folders, chosen by Accelerate's rule (the oldest by their
number), are deleted only once every ZeRO model's save of the new checkpoint has committed
(``EngineView.after_save_succeeds``; at once after a synchronous save), and never if one fails: until
then K+1 folders exist, the previous checkpoint among them.

[Note: a DeepSpeed plugin's save_state]
``Accelerator.save_state`` under a DeepSpeed plugin has each model's engine write its checkpoint
into the directory under the tag ``pytorch_model`` (``pytorch_model_1``, ... for more models),
DeepSpeed's ZeRO files, next to Accelerate's own files (RNG states, samplers, schedulers not
managed by DeepSpeed). ``load_state`` on such a directory (no ``zero_strategy_accelerate.json``)
loads each ZeRO model from its tag directory with :func:`zero_strategy.load_checkpoint`, which reads
DeepSpeed's format, and lets Accelerate restore the rest as usual.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
from pathlib import Path

from ..api import engine_of
from ..checkpoint import save_checkpoint
from ..checkpoint._load import prepare_load

STATE_FILE = "zero_strategy_accelerate.json"
FORMAT = 1


def zero_dir_name(index: int) -> str:
    return "zero_model" if index == 0 else f"zero_model_{index}"


@contextlib.contextmanager
def _accelerate_lists_without_zero(acc):
    from ._optimizer import ZeroAcceleratedOptimizer

    models, optimizers = acc._models, acc._optimizers
    acc._models = [m for m in models if not acc.is_zero_model(m)]
    acc._optimizers = [o for o in optimizers if not isinstance(o, ZeroAcceleratedOptimizer)]
    try:
        yield
    finally:
        acc._models, acc._optimizers = models, optimizers


def _optimizer_arg(record):
    opts = [o.zero_optimizer for o in record.optimizers]
    if not opts:
        return None
    return opts[0] if len(opts) == 1 else opts


def save_state(acc, super_save_state, output_dir, safe_serialization, kwargs) -> str:
    _refuse_pending(acc, "save_state")
    with _accelerate_lists_without_zero(acc), _no_deletion_before_the_save(acc) as doomed:
        location = super_save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
    location = Path(location)
    for i, record in enumerate(acc.zero_models):
        save_checkpoint(location / zero_dir_name(i), record.model, _optimizer_arg(record))
    if acc.is_main_process:
        info = {"format": FORMAT, "num_processes": acc.num_processes, "step": acc.step,
                "zero_models": [zero_dir_name(i) for i in range(len(acc.zero_models))],
                "zero_config": acc.zero_config.to_dict()}
        tmp = location / f"{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(info, indent=2))
        os.replace(tmp, location / STATE_FILE)
    acc.wait_for_everyone()
    _delete_after_the_commit(acc, doomed)
    return str(location)


@contextlib.contextmanager
def _no_deletion_before_the_save(acc):
    """Accelerate's ``total_limit`` deletion, taken out of its ``save_state`` (and put back, also on an
    error); yields the folders it would delete (main process). See [Note: total_limit deletes after the commit]."""
    project = acc.project_configuration
    limit = project.total_limit
    if not project.automatic_checkpoint_naming or limit is None or not acc.is_main_process:
        yield []
        return
    root = os.path.join(acc.project_dir, "checkpoints")
    folders = [os.path.join(root, f) for f in os.listdir(root)] if os.path.isdir(root) else []
    folders.sort(key=lambda folder: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", folder)[0]))  # Accelerate's order
    project.total_limit = None
    try:
        yield folders[:max(len(folders) + 1 - limit, 0)]
    finally:
        project.total_limit = limit


def _delete_after_the_commit(acc, doomed: list[str]) -> None:
    """Delete ``doomed`` once every ZeRO model's save has committed; never when one fails."""
    def delete() -> None:
        for folder in doomed:
            if os.path.lexists(folder):  # a save before this one, committed since, may have deleted it
                shutil.rmtree(folder)

    models = [record.model for record in acc.zero_models]
    if not doomed or not models:
        return delete()
    lock, left = threading.Lock(), [len(models)]

    def committed() -> None:
        with lock:
            left[0] -= 1
            if left[0] > 0:
                return
        delete()

    for model in models:
        if not engine_of(model).after_save_succeeds(committed):
            committed()  # a synchronous save: committed already


def load_state(acc, super_load_state, input_dir, load_kwargs, kwargs) -> None:
    _refuse_pending(acc, "load_state")
    input_dir = _resolve_input_dir(acc, input_dir)
    info_path = Path(input_dir) / STATE_FILE
    info = json.loads(info_path.read_text()) if info_path.is_file() else None
    sources = [Path(input_dir) / name for name in (info["zero_models"] if info is not None else [])]
    if info is None:  # See [Note: a DeepSpeed plugin's save_state]
        sources = [Path(input_dir) / _deepspeed_tag(i) for i in range(len(acc.zero_models) + 1)]
        sources = sources[:next((i for i, d in enumerate(sources) if not d.is_dir()), len(sources))]
    if len(sources) != len(acc.zero_models):
        raise ValueError(
            f"load_state({input_dir}): the checkpoint holds {len(sources)} ZeRO-sharded model(s) but this "
            f"ZeroAccelerator has prepared {len(acc.zero_models)}; prepare the same models (with their "
            "optimizers) before load_state"
            + ("" if info is not None else f" (no {STATE_FILE}: was it saved by a ZeroAccelerator, or by "
               "Accelerate's DeepSpeed plugin?)"))
    with contextlib.ExitStack() as stack:
        # every sharded checkpoint is checked (on every rank) before Accelerate restores anything and
        # before any model is loaded: a refused one leaves all as it was (See [Note: verify, agree,
        # then copy] in checkpoint/_load.py)
        loads = [stack.enter_context(prepare_load(source, record.model, _optimizer_arg(record)))
                 for source, record in zip(sources, acc.zero_models)]
        with _accelerate_lists_without_zero(acc):
            super_load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        for load in loads:
            load.commit()
    if info is not None and "step" in info:
        acc.step = int(info["step"])


def _deepspeed_tag(index: int) -> str:
    """The tag Accelerate's DeepSpeed plugin saves model ``index`` under (its ``MODEL_NAME``)."""
    return "pytorch_model" if index == 0 else f"pytorch_model_{index}"


def _refuse_pending(acc, what: str) -> None:
    if acc.pending_models:
        raise RuntimeError(
            f"ZeroAccelerator.{what}: {len(acc.pending_models)} model(s) were prepared without their optimizer and "
            "are not sharded yet; prepare the optimizer (accelerator.prepare(optimizer)) first")


def _resolve_input_dir(acc, input_dir) -> str:
    """The directory Accelerate's load_state would pick (it does not return it)."""
    if input_dir is not None:
        input_dir = os.path.expanduser(input_dir)
        if not os.path.isdir(input_dir):
            raise ValueError(f"Tried to find {input_dir} but folder does not exist")
        return input_dir
    if not acc.project_configuration.automatic_checkpoint_naming:
        raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
    base = os.path.join(acc.project_dir, "checkpoints")
    folders = [os.path.join(base, f) for f in os.listdir(base)]
    folders.sort(key=lambda f: [int(x) for x in re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)][0])
    return folders[-1]
