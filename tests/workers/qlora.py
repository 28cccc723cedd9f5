"""QLoRA under ZeRO: a 4-bit base saved once, LoRA adapters trained on 2 ranks against one process.

Each case (``dir``: a 4-bit checkpoint transformers quantized and saved, NF4 or FP4, uint8 or bf16
storage; ``preset``): every rank first runs the single-process reference (the same directory,
the same adapters, AdamW on the whole batch), then the same under ``zero_strategy.setup`` with
each rank on its half of the batch. Reported: both runs' losses, the largest adapter difference,
whether the base's packed bytes and quant states are unchanged, and at stage 3 the packed bytes
this rank holds (from the flat groups, the memory report and the parameters themselves).
A ``refuse`` case builds what is refused and reports the error.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM

from _worker import finish, run_cases, start

import zero_strategy as zs
from zero_strategy.api import _engine_of as engine_of

STEPS = 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(directory: str, kbit: bool):
    model = AutoModelForCausalLM.from_pretrained(directory, device_map="cpu", dtype=torch.float32)
    if kbit:  # PEFT's documented QLoRA recipe
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                                             init_lora_weights=False))  # B != 0: the first step moves A too
    model.train()
    return model


def _batch(step: int, rank: int, vocab: int):
    whole = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(5))  # one batch: the loss falls step by step
    return whole, whole[2 * rank:2 * rank + 2]


def _adapters(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def _base(model) -> dict[str, torch.Tensor]:
    """The packed weights as bytes and the quant states' tensors, as ``state_dict`` writes them."""
    return {k: (v.detach().view(torch.uint8) if v.dtype != torch.uint8 and v.dim() else v.detach()).clone()
            for k, v in model.state_dict().items() if "lora_" not in k and ("proj" in k)}


def _train(model, opt, rank: int, whole_batch: bool, steps: int = STEPS) -> list[float]:
    vocab = model.config.vocab_size
    losses = []
    for step in range(steps):
        whole, mine = _batch(step, rank, vocab)
        ids = whole if whole_batch else mine
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if not whole_batch:  # the whole batch's loss: the mean of the two halves (equal token counts)
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    return losses


def _live_bytes(dtype: torch.dtype, skip: list[torch.Tensor]) -> int:
    """Bytes of every distinct storage of ``dtype`` that a live Python tensor of this process points at,
    found by the garbage collector, not by the engine: the packed weights' shards, their placeholders,
    and whatever else still holds packed bytes (a whole copy left behind would show here). ``skip``:
    the worker's own copies."""
    import gc
    gc.collect()
    skipped = {t.untyped_storage().data_ptr() for t in skip}
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.dtype == dtype and obj.device.type == "cpu" and not obj.is_meta:
            storage = obj.untyped_storage()
            if storage.data_ptr() not in skipped and storage.nbytes():
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _packed_bytes(model, engine, skip: list[torch.Tensor]) -> dict:
    """Bytes of the packed 4-bit weights this rank holds at rest: in their flat groups' shards, counted by
    the memory report's own walk, in the parameters themselves (placeholders at stage 3), and in every
    live tensor of the storage dtype (uint8 storage: the double-quantized absmax is uint8 too, counted
    apart as ``state_bytes``)."""
    packed = [p for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"]
    ids = {id(p) for p in packed}
    groups = [g for g in engine.groups if any(id(s.param) in ids for s in g.slots)]
    assert all(all(id(s.param) in ids for s in g.slots) for g in groups), "packed weights share a group"
    held = sum(t.untyped_storage().nbytes() for g in groups for cat, _, t in g.held_tensors() if cat == "params")
    in_groups = sum(s.numel for g in groups for s in g.slots)
    return dict(held=held, group_count=len(groups), group_elems=[g.padded_numel for g in groups],
                itemsize=packed[0].element_size(), packed_numel=sum(p.numel() for p in packed),
                grouped_numel=in_groups,
                base_params=sum(p.quant_state.shape.numel() for p in packed),
                param_storage=sum(p.untyped_storage().nbytes() for p in packed),
                report_params=zs.memory_report(model).by_category["params"],
                live=_live_bytes(packed[0].dtype, skip),
                state_bytes=sum(t.numel() * t.element_size() for p in packed for t in _state_tensors(p.quant_state)
                                if t.dtype == packed[0].dtype))


def _state_tensors(state) -> list[torch.Tensor]:
    nested = getattr(state, "state2", None)
    out = [state.absmax, state.code] + ([nested.absmax, nested.code] if nested is not None else [])
    return [t for t in out if t is not None]


def _run(case: dict) -> dict:
    rank = dist.get_rank()
    if "refuse" in case:
        return _refuse(case)
    if case.get("teardown"):
        return _teardown(case)
    if case.get("loader"):
        return _one_call_loader(case)
    ref = _peft(case["dir"], case.get("kbit", False))
    base_before = _base(ref)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    ref_losses = _train(ref, ref_opt, rank, whole_batch=True)
    ref_adapters = _adapters(ref)
    probe = torch.randint(0, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(9))
    if case.get("seams"):
        with torch.no_grad():
            ref_merged = ref.merge_and_unload()(input_ids=probe).logits
    del ref, ref_opt

    model = _peft(case["dir"], case.get("kbit", False))
    start_adapters = _adapters(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = zs.ZeroConfig.preset(case["preset"], param_persistence_threshold=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, zopt = zs.setup(model, opt, config)
    memory = _packed_bytes(model, engine_of(model), list(base_before.values())) if config.stage == 3 else None
    losses = _train(model, zopt, rank, whole_batch=False)
    adapters = _adapters(model)
    base_after = _base(model)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    seams = _seams(model, case, ref_adapters, probe, ref_merged) if case.get("seams") else None
    return dict(seams=seams,
        case=case["case"], losses=losses, ref_losses=ref_losses,
        adapter_diff=max((adapters[k] - ref_adapters[k]).abs().max().item() for k in ref_adapters),
        adapter_moved=min((adapters[k] - start_adapters[k]).abs().max().item() for k in ref_adapters),
        adapter_names=sorted(adapters) == sorted(ref_adapters),
        only_lora_trains=all("lora_" in n for n in trainable) and bool(trainable),
        base_equal=sorted(base_after) == sorted(base_before)
        and all(torch.equal(base_after[k], base_before[k]) for k in base_before),
        base_keys=len(base_before), memory=memory,
        warnings=[str(w.message) for w in caught if "bitsandbytes" in str(w.message)],
    )


def _quantization(quant: str, storage: str):
    from transformers import BitsAndBytesConfig
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_compute_dtype=torch.float32,
                              bnb_4bit_use_double_quant=quant == "nf4", bnb_4bit_quant_storage=getattr(torch, storage))


def _one_call_loader(case: dict) -> dict:
    """``zero_strategy.transformers.from_pretrained(..., quantization_config=...)`` on the dense checkpoint,
    PEFT's adapters, ``setup``: the base equals what transformers' own quantizing load makes of the same
    directory (codes bit for bit, quant states equal), and training equals single-process QLoRA on that
    transformers-loaded base from the same starting adapters (the loader's adapters are built on the meta
    device and initialized at setup as PEFT initializes them, here ``init_lora_weights=False`` as in
    ``_peft``; the reference's own are drawn from another random stream, so it takes them from the set-up
    model)."""
    q = _quantization(case["quant"], case["storage"])
    config = zs.ZeroConfig.preset(case["preset"], param_persistence_threshold=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, zopt = _loaded(case["dense"], q, config)
    start_adapters = _adapters(model)
    drawn = all(bool(v.isfinite().all()) and v.abs().max() > 0 for v in start_adapters.values())
    base = _base(model)
    memory = _packed_bytes(model, engine_of(model), list(base.values())) if config.stage == 3 else None
    losses = _train(model, zopt, dist.get_rank(), whole_batch=False)
    adapters = _adapters(model)

    ref = AutoModelForCausalLM.from_pretrained(case["dense"], quantization_config=q, device_map="cpu",
                                               dtype=torch.float32)
    ref = get_peft_model(prepare_model_for_kbit_training(ref, use_gradient_checkpointing=False),
                         LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    ref.train()
    ref_base = _base(ref)
    with torch.no_grad():
        state = ref.state_dict()
        for k, v in start_adapters.items():
            state[k].copy_(v)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    ref_losses = _train(ref, ref_opt, dist.get_rank(), whole_batch=True)
    ref_adapters = _adapters(ref)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    resumed = _resumed(case, model, zopt, q, config, adapters, base) if case.get("resume") else None
    return dict(case=case["case"], losses=losses, ref_losses=ref_losses, resumed=resumed, drawn=drawn,
                adapter_diff=max((adapters[k] - ref_adapters[k]).abs().max().item() for k in ref_adapters),
                adapter_moved=min((adapters[k] - start_adapters[k]).abs().max().item() for k in ref_adapters),
                adapter_names=sorted(adapters) == sorted(ref_adapters),
                only_lora_trains=all("lora_" in n for n in trainable) and bool(trainable),
                base_equal=sorted(base) == sorted(ref_base) and all(torch.equal(base[k], ref_base[k]) for k in base),
                base_keys=len(base), memory=memory, loaded_in_4bit=bool(getattr(model, "is_loaded_in_4bit", False)),
                warnings=[str(w.message) for w in caught if "bitsandbytes" in str(w.message)])


def _loaded(dense: str, q, config):
    """The one-call loader's QLoRA: the 4-bit base loaded sharded, PEFT's recipe, setup."""
    from zero_strategy.transformers import from_pretrained
    model = from_pretrained(AutoModelForCausalLM, dense, quantization_config=q, dtype=torch.float32)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0,
                                             init_lora_weights=False))  # as _peft: B != 0, A moves at step 1
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return zs.setup(model, opt, config)


def _resumed(case: dict, model, zopt, q, config, adapters: dict, base: dict) -> dict:
    """``save_checkpoint`` of the trained run, ``load_checkpoint`` into a fresh one from the loader: the
    adapters, the packed base and the next step's loss equal the uninterrupted run's."""
    zs.save_checkpoint(case["checkpoint"], model, zopt)
    again, again_opt = _loaded(case["dense"], q, config)
    zs.load_checkpoint(case["checkpoint"], again, again_opt)
    restored, restored_base = _adapters(again), _base(again)
    next_loss = _train(model, zopt, dist.get_rank(), whole_batch=False, steps=1)
    again_loss = _train(again, again_opt, dist.get_rank(), whole_batch=False, steps=1)
    return dict(adapters_equal=all(torch.equal(restored[k], adapters[k]) for k in adapters),
                base_equal=all(torch.equal(restored_base[k], base[k]) for k in base),
                next_loss=next_loss, again_loss=again_loss)


def _seams(model, case: dict, ref_adapters: dict, probe, ref_merged) -> dict:
    """The user's own PEFT calls on the set-up model: ``save_pretrained`` on every rank (the adapter
    reloads with ``PeftModel.from_pretrained`` on a fresh 4-bit base, equal to the reference's), and
    ``merge_and_unload`` (logits equal the reference's merged model)."""
    from peft import PeftModel
    saved = case["saved"]
    model.save_pretrained(saved, is_main_process=dist.get_rank() == 0)
    dist.barrier()
    base = AutoModelForCausalLM.from_pretrained(case["dir"], device_map="cpu", dtype=torch.float32)
    reloaded = _adapters(PeftModel.from_pretrained(base, saved))
    packed = {n: p for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    full = zs.full_state_dict(model)  # fp32 by default for numbers; packed codes as they are stored
    kept = all(full[n].dtype == p.dtype for n, p in packed.items())
    with torch.no_grad():
        merged = model.merge_and_unload()(input_ids=probe).logits
    return dict(reloaded_diff=max((reloaded[k] - ref_adapters[k]).abs().max().item() for k in ref_adapters),
                reloaded_names=sorted(reloaded) == sorted(ref_adapters),
                merged_diff=(merged - ref_merged).abs().max().item(), full_state_dict_keeps_storage=kept)


def _teardown(case: dict) -> dict:
    """``zero_strategy.teardown`` gives back the packed codes as they were (bit for bit, in their storage
    dtype, whole on every rank) and bnb's CPU-repack switch as it was."""
    model = _peft(case["dir"], False)
    before = _base(model)
    linears = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    switch = [m.support_avx512bf16_for_cpu for m in linears]
    model, _ = zs.setup(model, None, zs.ZeroConfig.preset(case["preset"], param_persistence_threshold=0))
    zs.teardown(model)
    after = _base(model)
    return dict(case=case["case"], equal=sorted(after) == sorted(before)
                and all(torch.equal(after[k], before[k]) for k in before),
                dtypes=sorted({str(p.dtype) for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}),
                switch_restored=[m.support_avx512bf16_for_cpu for m in linears] == switch)


def _refuse(case: dict) -> dict:
    import bitsandbytes as bnb
    if case["refuse"] == "int8":
        model = torch.nn.Sequential(bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=False, bias=False))
    else:  # a 4-bit weight that was never quantized (built on the CPU, never moved to a device)
        model = torch.nn.Sequential(bnb.nn.Linear4bit(64, 64, bias=False, quant_storage=torch.bfloat16))
    try:
        zs.setup(model, None, "zero3")
    except ValueError as e:
        return dict(case=case["case"], error_message=str(e))
    return dict(case=case["case"], error_message=None)


if __name__ == "__main__":
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], _run)})
