"""``accelerator.save_model(model, d)`` the way Accelerate users write it, sharded and stock.

args["mode"]:

* ``"zero"`` (``accelerate launch``, 2 processes): a ZeroAccelerator at stage 3 (every
  parameter sharded) trains a tiny Llama (tied embeddings, an integer and a float buffer of
  its own) 2 SGD steps (linear in the gradient, so the two runs agree to fp32 rounding), each
  process on its own rows; then ``save_model`` into one file and into
  shards of ``SHARD`` bytes, each measured on every rank: the peak of the engine's
  "gathered" bytes during the call (``memory_report`` after ``reset_peak``) and the peak
  resident memory above the RSS before it (``VmHWM``, tests/_rss.py). Rank 0 then compares
  the files with ``accelerator.get_state_dict(model)`` (bit for bit).
* ``"stock"`` (one plain process): ``accelerate.Accelerator()`` trains the same model on both
  processes' rows at once (what the average of the two gradients is) and saves it with stock
  ``save_model``: the reference the test compares the files with.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, LAYERS, STEPS, ROWS = 256, 6, 2, 2
SHARD = "8MB"
SAVES = {"whole": {}, "split": {"max_shard_size": SHARD}}


def tiny_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1536, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg)
    model.register_buffer("seen", torch.arange(3))  # saved as stored (int64)
    model.model.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
    return model


def rows(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, 16), generator=torch.Generator().manual_seed(10 * step + rank))


def sizes(model: LlamaForCausalLM) -> dict:
    """fp32 bytes of each block and of the root (what is not in a block, tied weights once)."""
    blocks = [sum(p.numel() * 4 for p in layer.parameters()) for layer in model.model.layers]
    in_blocks = {id(p) for layer in model.model.layers for p in layer.parameters()}
    root = sum(p.numel() * 4 for p in model.parameters() if id(p) not in in_blocks)
    return {"blocks": blocks, "root": root, "model": root + sum(blocks)}




def saved(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run_zero(out: Path) -> None:
    from _rss import measured, return_freed_memory_to_the_os
    from _worker import finish

    from zero_strategy.accelerate import ZeroAccelerator

    return_freed_memory_to_the_os()
    acc = ZeroAccelerator({"stage": 3, "param_persistence_threshold": 0})
    model = tiny_llama()
    report = {"rank": acc.process_index, "num_processes": acc.num_processes, "sizes": sizes(model)}
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    for step in range(STEPS):
        ids = rows(step, acc.process_index)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    acc.save_model(model, out / "zero_warm", max_shard_size=SHARD)  # the first save imports; unmeasured
    for name, kwargs in SAVES.items():
        _, report[name] = measured(model, lambda: acc.save_model(model, out / f"zero_{name}", **kwargs))
    full = acc.get_state_dict(model)
    if acc.is_main_process:
        from accelerate.utils.other import clean_state_dict_for_safetensors

        full = clean_state_dict_for_safetensors(full)  # stock save_model's step: a tied tensor once
        for name in SAVES:
            got = saved(out / f"zero_{name}")
            report[name]["vs_get_state_dict"] = {
                "extra": sorted(set(got) - set(full)),
                "missing": sorted(set(full) - set(got)),
                "unequal": sorted(k for k in got if k in full and not (
                    got[k].dtype == full[k].dtype and torch.equal(got[k], full[k])))}
    finish(out, report)


def run_stock(out: Path) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = tiny_llama()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    for step in range(STEPS):
        ids = torch.cat([rows(step, r) for r in range(2)])
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    for name, kwargs in SAVES.items():
        acc.save_model(model, out / f"stock_{name}", **kwargs)
    (out / "rank0.json").write_text(json.dumps({"distributed_type": str(acc.distributed_type)}))
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    args = json.loads((out / "args.json").read_text())
    (run_zero if args["mode"] == "zero" else run_stock)(out)


if __name__ == "__main__":
    main()
