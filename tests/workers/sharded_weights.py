"""Stage-3 loading of a pretrained HF directory: each rank reads only its slices."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import LlamaForCausalLM

from _models import tiny_llama_config as config
from _worker import finish, start

import zero_strategy as zs
from zero_strategy.checkpoint import load_sharded_weights, safetensors_reader


def main() -> None:
    args, out = start()
    rank = dist.get_rank()
    reference = LlamaForCausalLM.from_pretrained(args["dir"]).eval()  # unsharded, for comparison
    with torch.device("meta"):
        model = LlamaForCausalLM(config())
    model, _ = zs.setup(model, None, zs.ZeroConfig(stage=args["stage"], param_persistence_threshold=0),
                        param_init_fn=model._init_weights)  # HF's own init: also rotary buffers
    elements_read = []
    reader = safetensors_reader(args["dir"])

    def counting(names, a, b):
        elements_read.append(b - a)
        return reader(names, a, b)

    load_sharded_weights(model, counting)
    model.eval()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    # generate() with different lengths on each rank: synced_gpus keeps the ranks in step
    gen = model.generate(ids, max_new_tokens=3 + 2 * rank, do_sample=False, synced_gpus=True)
    total = sum(p.numel() for p in reference.parameters())
    finish(out, dict(logit_diff=diff, elements_read=sum(elements_read), total=total,
                     generated=gen.shape[1]))


if __name__ == "__main__":
    main()
