"""Ulysses sequence parallelism against one process training on the whole sequences.

Every rank trains a tiny Llama twice from the same weights: the reference, a plain
``LlamaForCausalLM`` in this process on whole sequences (``model(input_ids, labels).loss``,
torch's optimizer, torch's ``clip_grad_norm_``), and the set-up model with
``sequence_parallel_size=sp`` on its shard of the same sequences
(``zs.shard_sequence`` -> ``model(**shard)`` -> ``model.loss_function`` ->
``zs.sequence_parallel_loss``). With data parallelism (world > sp) each data-parallel rank
gets its own samples and the reference averages over them, as DDP would.

Each case reports the per-step losses of both and the worst relative difference of the
final full weights.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from _worker import finish, run_cases, start, worst_rel_diff

import zero_strategy as zs

VOCAB = 64


def tiny_llama(case: dict) -> LlamaForCausalLM:
    flash = case.get("flash")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=case.get("kv_heads", 2),
                      max_position_embeddings=128, tie_word_embeddings=False,
                      attn_implementation="sdpa" if flash else case.get("attn", "sdpa"))
    torch.manual_seed(7)
    model = LlamaForCausalLM(cfg)
    if flash:  # as from_pretrained(attn_implementation=flash) leaves it, past the check for flash_attn
        model.config._attn_implementation = flash
    return model


def install_flash_on_cpu(name: str) -> list[str]:
    """transformers' flash-attention path (its wrapper, ``_flash_attention_forward``, the lazy kernel
    import by ``config._attn_implementation``) with a ``flash_attn_func`` made of torch's SDPA, since
    flash_attn does not run on a CPU. A Hub name (``kernels-community/...``) is registered as
    ``load_and_register_attn_kernel`` registers a kernel that has ``flash_attn_varlen_func``.
    Returns the names the kernel was imported by."""
    import torch.nn.functional as F
    import transformers.modeling_flash_attention_utils as fa
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):  # [b, s, heads, d]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             dropout_p=dropout_p, is_causal=causal, scale=softmax_scale,
                                             enable_gqa=True)
        return out.transpose(1, 2)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False):
        raise AssertionError("the varlen kernel: the sequence was taken as padded or packed")

    imported: list[str] = []

    def lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        imported.append(implementation)
        if implementation != name:
            raise ValueError(f"no flash kernel is named {implementation!r}")
        return flash_attn_func, flash_attn_varlen_func, None, fa._pad_input, fa._unpad_input

    fa._lazy_imports, fa._loaded_implementation = lazy_imports, None
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, flash_attention_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return imported


def samples(step: int, count: int, seq: int, masked_prompt: int) -> list[dict]:
    """``count`` whole samples of step ``step`` (the same on every rank): one sequence each."""
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(1000 * step + i)
        ids = torch.randint(1, VOCAB, (1, seq), generator=g)
        labels = ids.clone()
        labels[:, :masked_prompt] = -100  # prompt tokens: no loss (a whole shard of them when >= seq/sp + 1)
        out.append(dict(input_ids=ids, labels=labels))
    return out


def optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


def run(case: dict) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    sp = case["sp"]
    dp, dp_rank = world // sp, rank // sp
    accum, steps, clip = case.get("accum", 1), case.get("steps", 3), case.get("clip")
    imported = install_flash_on_cpu(case["flash"]) if case.get("flash") else []
    base = tiny_llama(case)
    ref = copy.deepcopy(base)
    ref_opt = optimizer(case.get("optimizer", "sgd"), ref.parameters())
    model = copy.deepcopy(base)
    if case.get("checkpointing"):  # activations recomputed in backward: the all-to-alls run again there
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    config = dict(stage=case["stage"], param_persistence_threshold=0, sequence_parallel_size=sp,
                  gradient_clipping=clip, precision=case.get("precision", "fp32"))
    if case.get("offload"):
        where = case["offload"] if case["offload"] == "cpu" else {"device": "nvme", "path": f"{case['nvme_path']}/r{rank}"}
        config["offload_optimizer"] = where
        if case["stage"] == 3:
            config["offload_params"] = where
    if case.get("tiled_loss"):  # the head and loss chunk by chunk: the model's loss, no logits
        config["tiled_loss"] = case["tiled_loss"]
    if case.get("preset"):  # a preset (zero_auto) instead of a stage
        config = dict(preset=case["preset"], sequence_parallel_size=sp)
    model, zopt = zs.setup(model, optimizer(case.get("optimizer", "sgd"), model.parameters()), config)
    losses, ref_losses = [], []
    for step in range(steps):
        data = samples(step, dp * accum, case.get("seq", 64), case.get("masked_prompt", 0))
        # the reference: every data-parallel rank's samples in one process, averaged like DDP
        ref_loss_sum = 0.0
        for d in range(dp):
            for a in range(accum):
                loss = ref(**data[d * accum + a]).loss / (dp * accum)
                loss.backward()
                ref_loss_sum += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss_sum)
        step_loss = 0.0
        for a in range(accum):
            shard = zs.shard_sequence(data[dp_rank * accum + a], model)
            if case.get("tiled_loss"):  # the shard's loss from the model itself, its logits never whole
                out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                            shift_labels=shard["shift_labels"])
                assert out.logits is None, "the tiled loss made the logits"
                loss = out.loss
            else:
                out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
                loss = model.loss_function(logits=out.logits, labels=None, shift_labels=shard["shift_labels"],
                                           vocab_size=VOCAB)
            loss = zs.sequence_parallel_loss(loss, shard["shift_labels"], model) / accum
            if a < accum - 1:
                with zs.no_sync(model):
                    loss.backward()
            else:
                loss.backward()
            step_loss += loss.item()
        zopt.step()
        zopt.zero_grad()
        mean = torch.tensor([step_loss])
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    full = {k: v.float() for k, v in zs.full_state_dict(model).items()}
    wdiff, worst = worst_rel_diff(full, ref.state_dict())
    zs.teardown(model, keep_weights=False)
    return dict(case=case, losses=losses, ref_losses=ref_losses, weight_rel_diff=wdiff, worst_tensor=worst,
                attn_after_teardown=model.config._attn_implementation, flash_imported=sorted(set(imported)))


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run)})


if __name__ == "__main__":
    main()
