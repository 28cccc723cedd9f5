"""What ``setup`` adjusts on Hugging Face transformers and PEFT models, and why.

The engine never imports these libraries: a model of theirs exists only if the user
imported them, so they are looked up in ``sys.modules``. Each adjustment is an
instance attribute that wraps the library's own method (:func:`shadow`) (the class is untouched, other
models are unaffected) and is removed by ``teardown``.

[Note: generate() under stage 3]
``generate()`` runs one forward per new token until every sequence of *this rank* is
done, so ranks whose prompts end (EOS, a shorter ``max_new_tokens``) at different
steps run different numbers of forwards. At stage 3 each forward all-gathers, so the
rank that finishes first leaves the others blocked in a gather until the process
group's timeout. transformers has the cure, ``synced_gpus=True`` (a finished rank
keeps running dummy forwards until all are done; each step costs one scalar
all-reduce), and turns it on by itself only for DeepSpeed ZeRO-3 and FSDP. We make it
the default of every ``GenerationMixin`` module in a set-up model whose parameters
are sharded over more than one rank; an explicit ``synced_gpus=False`` is kept (and
a mismatch then ends in :class:`~zero_strategy.CollectiveTimeout`, not a hang). The
same wrapper runs ``generate()`` inside ``gathered_for_generation`` when
``gather_once_in_generate(model)`` asked for it (the TRL front end does). Inside that
block (also one the user opened) every unit stays gathered and a forward issues no
collective, so ranks may stop at different steps: ``synced_gpus`` is left off there,
which saves one all-reduce and one wait for the slowest rank per token.

[Note: PEFT merges under stage 3]
``merge_and_unload()``, ``merge_adapter()`` and ``unmerge_adapter()`` rewrite base
weights in place from the adapter weights. At rest a stage-3 parameter is a
placeholder that refuses writes, so they are run with the units they touch gathered
and every rank writes its own slice back (the merge is deterministic, so every rank
computed the same values: nothing is broadcast). ``safe_merge=True`` replaces
``weight.data`` instead of writing into it; that is taken back into the flat buffer.
The merged model stays set up: save it with ``save_pretrained`` on every rank (at stage 3
it streams unit by unit: See [Note: streamed save_pretrained] in _engine/streamed_saves.py).

[Note: resize_token_embeddings after setup]
Resizing replaces the embedding's data by a tensor of another shape, while its flat
buffer, shards, fp32 master and optimizer state were sized at setup (and at stage 3
the old rows are not even on this rank). Rather than let the next gather undo the
resize, or train a tensor the optimizer does not hold, a set-up model refuses it with
the fix: resize before ``setup`` / ``accelerator.prepare`` / ``Trainer(...)``, as
DeepSpeed-ZeRO-3 and FSDP users do.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import TYPE_CHECKING, Callable

from torch import nn

from .gather import modified_on_every_rank
from .generation import around_generate
from .streamed_saves import install_saves

if TYPE_CHECKING:
    from .engine import ZeroEngine

_PEFT_MERGES = ("merge_and_unload", "merge_adapter", "unmerge_adapter")


def install(model: nn.Module, engine: "ZeroEngine") -> list[Callable[[], None]]:
    """Adjust the transformers / PEFT modules inside ``model``; returns the undo callbacks."""
    transformers = sys.modules.get("transformers")
    peft_tuners = sys.modules.get("peft.tuners.tuners_utils")
    if transformers is None and peft_tuners is None:
        return []
    peft_model = getattr(sys.modules.get("peft.peft_model"), "PeftModel", None)
    generation_mixin = getattr(transformers, "GenerationMixin", None) if transformers else None
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers else None
    base_tuner = getattr(peft_tuners, "BaseTuner", None) if peft_tuners else None
    undo: list[Callable[[], None]] = []
    for module in model.modules():
        wraps_generate = engine.plan.shards_parameters or engine.config.offload_states_during_generation
        if wraps_generate and generation_mixin is not None and isinstance(module, generation_mixin):
            undo.append(shadow(module, "generate", functools.partial(_engine_generate, engine)))
        if pretrained is not None and isinstance(module, pretrained):
            undo.append(shadow(module, "resize_token_embeddings", _refuse_resize))
        if engine.plan.shards_parameters:  # See [Note: streamed save_pretrained] in _engine/streamed_saves.py
            undo.extend(install_saves(module, engine, pretrained, peft_model, shadow))
        if base_tuner is not None and isinstance(module, base_tuner):
            for name in _PEFT_MERGES:
                if hasattr(module, name):
                    undo.append(shadow(module, name, functools.partial(_merge_gathered, engine)))
    return undo


def shadow(module: nn.Module, name: str, make: Callable) -> Callable[[], None]:
    """Shadow ``module.<name>`` by ``make(original)``; the returned callback removes it."""
    original = getattr(module, name)
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    module.__dict__[name] = wrapper

    def remove() -> None:
        if module.__dict__.get(name) is wrapper:
            del module.__dict__[name]
    return remove


def _engine_generate(engine: "ZeroEngine", original: Callable) -> Callable:
    """See [Note: generate() under stage 3]; gathers once when the engine's policy says so (See
    [Note: gathered for generation] in _engine/generation.py), with the training state the config names
    (``offload_states_during_generation``) off the device meanwhile, at every stage."""
    engine_ref = weakref.ref(engine)  # the model holds the wrapper: no cycle through the engine

    def generate(*args, **kwargs):
        engine = engine_ref()
        if engine is None or engine.ended:
            return original(*args, **kwargs)
        with around_generate(engine):
            if kwargs.get("synced_gpus") is None and engine.plan.shards_parameters:  # held gathered: no collective
                kwargs["synced_gpus"] = engine.comm.world_size > 1 and not engine.generation.active
            return original(*args, **kwargs)
    return generate


def _merge_gathered(engine: "ZeroEngine", original: Callable) -> Callable:
    """See [Note: PEFT merges under stage 3]."""
    engine_ref = weakref.ref(engine)  # as in _engine_generate: no cycle through the engine

    def merge(*args, **kwargs):
        engine = engine_ref()
        if engine is None or engine.ended:
            return original(*args, **kwargs)
        with modified_on_every_rank(engine):
            return original(*args, **kwargs)
    return merge


def _refuse_resize(original: Callable) -> Callable:
    """See [Note: resize_token_embeddings after setup]."""
    def resize_token_embeddings(new_num_tokens=None, pad_to_multiple_of=None, *args, **kwargs):
        if new_num_tokens is None and pad_to_multiple_of is None:
            return original(new_num_tokens, pad_to_multiple_of, *args, **kwargs)  # only returns the module
        raise RuntimeError(
            "zero_strategy: resize_token_embeddings() on a model that is already set up: the embedding's "
            "flat buffer, shards, fp32 master and optimizer state were sized at setup, so a resize cannot "
            "be kept. Resize first, then set up: call model.resize_token_embeddings(len(tokenizer)) "
            "before zero_strategy.setup(...), accelerator.prepare(...), the Trainer(...) or "
            "trainer.fit(...) (in a LightningModule: in __init__ or configure_model); for PEFT, before "
            "get_peft_model. To resize a set-up model, zero_strategy.teardown(model) it first.")
    return resize_token_embeddings
