"""A real Hugging Face model (tiny Llama, tied or untied embeddings) under each stage vs DDP, and generate()."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

from _worker import finish, start

import zero_strategy as zs


def tiny_llama(tied: bool = True) -> LlamaForCausalLM:
    """Untied: a vocabulary of 512, so the embeddings and the head are large beside a block."""
    cfg = LlamaConfig(vocab_size=64 if tied else 512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    torch.manual_seed(3)
    return LlamaForCausalLM(cfg)


def main() -> None:
    args, out = start()
    rank = dist.get_rank()
    results = []
    for stage in args["stages"]:
        base = tiny_llama(args.get("tied", True))
        ref = copy.deepcopy(base)
        ddp = DDP(ref)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        model = copy.deepcopy(base)
        model, zopt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                               zs.ZeroConfig(stage=stage, param_persistence_threshold=0))
        units = [u.name for u in zs.api._engine_of(model).units]
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            ids = torch.randint(0, 64, (2, 12), generator=g)
            lr_ = ddp(input_ids=ids, labels=ids).loss
            lr_.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            lz = model(input_ids=ids, labels=ids).loss
            lz.backward()
            zopt.step()
            zopt.zero_grad()
            losses.append((lz.item(), lr_.item()))
        full = zs.full_state_dict(model)
        wdiff = max((full[k] - v.float()).abs().max().item() for k, v in ref.state_dict().items())
        prompt = torch.tensor([[1, 5, 9, 3]])
        gen = model.generate(prompt, max_new_tokens=6, do_sample=False)
        gen_ref = ref.generate(prompt, max_new_tokens=6, do_sample=False)
        results.append(dict(stage=stage, units=units, losses=losses, weight_diff=wdiff,
                            generated=gen.tolist(), generated_ref=gen_ref.tolist()))
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
