"""Weight sync to vLLM for TRL's online trainers at stage 3: real weights, one unit at a time.

[Note: weight sync to vLLM at stage 3]
TRL's online trainers (``GRPOTrainer``, ``RLOOTrainer``, ``DistillationTrainer`` and the
experimental GOLD, SDPO, SDFT and IW-OPD trainers) generate through one object,
``trl.generation.vllm_generation.VLLMGeneration``. Before generating with new weights its
``sync_weights()`` walks ``_iter_named_params()`` and hands each ``(name, tensor)`` to the
engine: ``VLLMClient.update_named_params`` (server mode: a metadata pass first, then the
stream; only the main process sends, every process iterates) or
``llm...model.load_weights([(name, tensor)])`` (colocate mode, every process). That
iterator gathers parameters only when it detects DeepSpeed ZeRO-3 or FSDP; otherwise it
reads ``param.data``, which at our stage 3 is a NaN placeholder between forwards, so
vLLM would silently generate from NaN weights until the rewards collapse.

So the ZeRO trainer replaces that one iterator: once the trainer is built, its
``vllm_generation`` object gets a subclass of its own class that overrides only
``_iter_named_params`` (the trainer builds the object inside its ``__init__``, so it cannot
be handed another class; the subclass adds no state, so switching the instance's class
changes nothing else). Everything else, the two modes, sleep mode, the prefix-cache reset,
stays TRL's. When the model's parameters are
sharded it yields every parameter under the name TRL would give it, unit by unit: the
unit is gathered, its parameters are yielded, the unit is released before the next one
is gathered. Units come in the order their first parameter appears in the model, so the
root's final norm and head come with the embedding rather than last (vLLM loads by name,
and the server's metadata is read from the same iterator). At stages 1-2 (parameters replicated and
current) and before ``train()`` has sharded the model, TRL's own iterator runs.

Each yielded tensor is a copy, not a view of the gathered unit: releasing a unit frees
its full buffer (its storage is resized to zero), and a consumer may hold tensors
across items (vLLM's packed NCCL producer concatenates several before broadcasting).
Memory is bounded by one gathered unit, one parameter's copy (one LoRA layer's merged
weight under PEFT) and what the consumer itself buffers.

PEFT: TRL merges the adapters into the base weights with the whole model gathered, sends
the base weights under their original names, and unmerges. Here each LoRA layer's merged
weight is computed out of place from its gathered unit (PEFT's own ``get_delta_weight``,
or the variant's ``merge_safe`` for DoRA and the other LoRA variants), so nothing is written
into the model and nothing has to be unmerged. Other PEFT methods are refused at stage 3.

``OnlineDPOTrainer`` (experimental) pushes weights with its own method,
``_move_model_to_vllm_inner``, which reads ``param.data`` the same way; the ZeRO class that
``zero_trainer`` builds for a trainer class with that method overrides it with the same
stream (``update_named_param`` per weight from the main process inside the one
``weight_update()`` its caller opens, or ``load_weights`` on every process). Trainers that
push weights any other way (the asynchronous trainers' weight transfer) are refused at
stage 3 when the trainer is built, naming the fix.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from .. import api
from .._engine.plan import plan_for

_ZERO_GENERATION_CLASSES: dict[type, type] = {}
_STREAMING_PUSHES: set = set()  # the _move_model_to_vllm_inner overrides made by weight_push_overrides


def adopt_vllm_weight_sync(trainer) -> None:
    """Make ``trainer``'s weight sync to vLLM send real weights at stage 3, or refuse now.

    Called once the trainer is built (every process: the decisions below depend only on
    the class, the arguments and the model, so all processes raise together).
    """
    if not _talks_to_vllm(trainer):
        return
    name = type(trainer).__name__
    stage3 = plan_for(trainer.accelerator.zero_config.stage).shards_parameters
    generation = getattr(trainer, "vllm_generation", None)
    try:
        from trl.generation.vllm_generation import VLLMGeneration
    except ImportError:  # a trainer with vLLM settings from elsewhere: its weight push is its own
        VLLMGeneration = None

    if getattr(type(trainer), "_move_model_to_vllm_inner", None) in _STREAMING_PUSHES:
        if stage3:
            _check_peft_method(trainer.model, name)
        return
    if VLLMGeneration is None or not isinstance(generation, VLLMGeneration):
        if stage3:
            raise NotImplementedError(
                f"{name}: this trainer pushes its weights to vLLM with its own code (not through TRL's "
                "VLLMGeneration), which reads the stage-3 placeholders and would send NaN weights; use stage 1 or 2 "
                "(zero_config='zero2'), generate without vLLM (use_vllm=False), or a trainer whose weight sync "
                "the ZeRO trainer streams unit by unit (GRPOTrainer, RLOOTrainer, OnlineDPOTrainer: build it with "
                "zero_trainer(cls))")
        return
    if stage3:
        _check_peft_method(trainer.model, name)
    if type(generation) not in _ZERO_GENERATION_CLASSES.values():
        generation.__class__ = _zero_generation_class(type(generation))


def _talks_to_vllm(trainer) -> bool:
    """``use_vllm=True``; the asynchronous trainers have no switch and always generate with vLLM."""
    args = trainer.args
    if hasattr(args, "use_vllm"):
        return bool(args.use_vllm)
    return hasattr(args, "vllm_server_base_url")


def _check_peft_method(model: nn.Module, trainer_name: str) -> None:
    config = getattr(model, "peft_config", None)
    if not isinstance(config, dict):
        return
    methods = {str(getattr(c, "peft_type", "?")).rsplit(".", 1)[-1] for c in config.values()}
    if methods - {"LORA"}:
        raise NotImplementedError(
            f"{trainer_name}: the vLLM weight sync at stage 3 merges LoRA adapters unit by unit; this model's "
            f"adapters are {sorted(methods)}. Use LoRA, stage 1 or 2 (zero_config='zero2'), or use_vllm=False")


def _zero_generation_class(cls: type) -> type:
    """``cls`` with ``_iter_named_params`` streaming the sharded model; one class per ``cls``."""
    made = _ZERO_GENERATION_CLASSES.get(cls)
    if made is None:
        def _iter_named_params(self):
            model = self.model
            if not (api.is_set_up(model) and api.engine_of(model).shards_parameters):
                yield from cls._iter_named_params(self)  # replicated parameters: TRL's own path is right
                return
            yield from stream_named_parameters(model, self._fix_param_name_to_vllm)

        _iter_named_params.__doc__ = "The model's weights, one gathered unit at a time (see _vllm_sync.py)."
        made = type(f"Zero{cls.__name__}", (cls,), {"__module__": __name__, "_iter_named_params": _iter_named_params})
        _ZERO_GENERATION_CLASSES[cls] = made
    return made


def weight_push_overrides(trainer_cls: type) -> dict:
    """For ``zero_trainer(trainer_cls)``: a streaming ``_move_model_to_vllm_inner`` if the class has one."""
    stock = getattr(trainer_cls, "_move_model_to_vllm_inner", None)
    if not callable(stock):
        return {}

    def _move_model_to_vllm_inner(self):
        model = self.model
        if not (api.is_set_up(model) and api.engine_of(model).shards_parameters):
            return stock(self)  # replicated parameters: the trainer's own push is right
        stream = stream_named_parameters(model, self._fix_param_name_to_vllm)
        if self.vllm_mode == "server":
            for name, tensor in stream:  # every process iterates: each unit is an all-gather
                if self.accelerator.is_main_process:
                    self.vllm_client.update_named_param(name, tensor)
        else:
            engine_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
            for name, tensor in stream:
                engine_model.load_weights([(name, tensor)])

    _move_model_to_vllm_inner.__doc__ = "The model's weights to vLLM, one gathered unit at a time (see _vllm_sync.py)."
    _STREAMING_PUSHES.add(_move_model_to_vllm_inner)
    return {"_move_model_to_vllm_inner": _move_model_to_vllm_inner}


@torch.no_grad()
def stream_named_parameters(model: nn.Module, fix_name: Callable[..., str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(vLLM name, full current weight)`` for every parameter, one gathered unit at a time.

    Every process must iterate to the end (each unit is an all-gather). Tied weights come
    once, under their first name, as vLLM expects. See [Note: weight sync to vLLM at stage 3].
    """
    peft = _peft_view(model)
    for members in api.gathered_units(model):  # the last list: parameters not managed, always whole
        for name, p in members:
            item = _vllm_item(name, p, peft, fix_name)
            if item is not None:
                yield item


def _vllm_item(name: str, p: nn.Parameter, peft, fix_name) -> tuple[str, torch.Tensor] | None:
    if peft is None:
        return fix_name(name), p.detach().clone()
    prefix, merged_value = peft
    # TRL's PEFT naming: base weights under their original names, adapters and saved originals left out
    if prefix in name or "original_module" in name:
        return None
    vllm_name = fix_name(name.removeprefix("base_model.model.").replace(".base_layer", ""),
                         extra_prefixes=["modules_to_save.default."])
    return vllm_name, merged_value(p)


def _peft_view(model: nn.Module):
    """For a PEFT model: (adapter name prefix, parameter -> merged value); else None."""
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import check_adapters_to_merge
    except ImportError:
        return None
    prefix = getattr(model, "prefix", None)
    if prefix is None or not hasattr(model, "peft_config"):
        return None
    layer_of: dict[int, tuple[LoraLayer, str]] = {}  # id(base param) -> (its LoRA layer, "weight" | "bias")
    for module in model.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            for kind in ("weight", "bias"):
                t = getattr(base, kind, None)
                if isinstance(t, nn.Parameter):
                    layer_of[id(t)] = (module, kind)

    def merged_value(p: nn.Parameter) -> torch.Tensor:
        value = p.detach().clone()
        if id(p) not in layer_of:
            return value
        layer, kind = layer_of[id(p)]
        if layer.disable_adapters:
            return value
        for adapter in check_adapters_to_merge(layer, None):  # active and not merged already
            if adapter not in layer.lora_A:
                continue
            if kind == "bias":
                if layer.lora_bias.get(adapter, False):
                    value += (layer.lora_B[adapter].bias * layer.scaling[adapter]).to(value.dtype)
            elif adapter in getattr(layer, "lora_variant", {}):  # DoRA and the other variants: PEFT's own merge
                value = layer.lora_variant[adapter].merge_safe(layer, adapter, value)
            else:
                value += layer.get_delta_weight(adapter).to(value.dtype)
        return value

    return prefix, merged_value
