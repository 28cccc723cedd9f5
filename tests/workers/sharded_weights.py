"""Loading of a pretrained HF directory sharded: each rank reads only its slices.

``args["loader"]``: ``"three_calls"`` (meta build, ``setup(param_init_fn=...)``,
``load_sharded_weights``), ``"one_call"`` (``zero_strategy.transformers.from_pretrained``
then ``setup``) or ``"accelerate"`` (``from_pretrained`` then ``ZeroAccelerator.prepare``
with an optimizer, Accelerate's own idiom).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from _models import tiny_llama_config as config
from _worker import finish, start

import zero_strategy as zs
from zero_strategy.checkpoint import load_sharded_weights, safetensors_reader
from zero_strategy._engine.deferred_weights import pending_weights


def _counting(reader, counts):
    def read(names, a, b):
        counts.append(b - a)
        return reader(names, a, b)
    return read


def main() -> None:
    args, out = start()
    rank = dist.get_rank()
    reference = LlamaForCausalLM.from_pretrained(args["dir"]).eval()  # unsharded, for comparison
    cfg = zs.ZeroConfig(stage=args["stage"], param_persistence_threshold=0)
    elements_read: list[int] = []
    loader = args.get("loader", "three_calls")
    if loader == "three_calls":
        with torch.device("meta"):
            model = LlamaForCausalLM(config())
        model, _ = zs.setup(model, None, cfg, param_init_fn=model._init_weights)  # HF's own init: also rotary buffers
        load_sharded_weights(model, _counting(safetensors_reader(args["dir"]), elements_read))
        model.eval()
    else:
        from zero_strategy.transformers import from_pretrained
        model = from_pretrained(AutoModelForCausalLM, args["dir"])
        assert all(p.is_meta for p in model.parameters()) and not model.training
        [(_, pending)] = pending_weights(model)
        pending.read = _counting(pending.read, elements_read)
        if loader == "one_call":
            model, _ = zs.setup(model, None, cfg)
        else:
            from zero_strategy.accelerate import ZeroAccelerator
            accelerator = ZeroAccelerator(zero_config=cfg, cpu=True)
            model, _ = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
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
