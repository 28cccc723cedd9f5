"""Ranks that use different parameters, in the loop Accelerate's docs write: stock Accelerate
with ``DistributedDataParallelKwargs(find_unused_parameters=True)`` (DDP, the oracle) vs
ZeroAccelerator presets, under ``accelerate launch``.

Two models, trained on prepared data loaders (each process gets its own batches, so the
routing differs per process as in real training):

* ``mixtral``: a tiny ``MixtralForCausalLM`` from its config (top-1 routing over 4 experts,
  trained through ``labels``), the Hugging Face way;
* ``vlm``: the LLaVA-style TinyVLM of tests/_routed_models.py; a batch carries
  ``pixel_values`` only where its rows have images: at step 0 only process 0 has them, step
  1 is text-only on both, steps 2-3 images on process 0 again.

Each ZeroAccelerator run reports the largest relative difference of its final full weights
from the stock run's (computed here, in the same process).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _routed_models import SEQ, VOCAB, TinyVLM  # noqa: E402
from _worker import finish, run_cases, worst_rel_diff  # noqa: E402

import accelerate  # noqa: E402
from accelerate.utils import DistributedDataParallelKwargs  # noqa: E402
from zero_strategy.accelerate import ZeroAccelerator  # noqa: E402

ROWS, STEPS = 2, 4  # rows per process and batch, optimizer steps
PRESETS = ["zero1", "zero2", "zero3", "zero3_offload"]


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                           num_experts_per_tok=1, max_position_embeddings=32)
    return MixtralForCausalLM(config)


def dataset(kind: str):
    """Rows in the order the prepared loaders deal them: batch b goes to process b % 2."""
    g = torch.Generator().manual_seed(5)
    n = ROWS * 2 * STEPS
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    batch_of_row = torch.arange(n) // ROWS
    has_image = (batch_of_row % 2 == 0) & (batch_of_row // 2 != 1)  # process 0, not at step 1
    pixels = torch.randn(n, 3, 4, generator=g)
    return torch.utils.data.TensorDataset(tokens, pixels, has_image)


def loss_of(kind: str, model, batch):
    tokens, pixels, has_image = batch
    if kind == "mixtral":
        return model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
    logits = model(tokens[:, :-1], pixel_values=pixels if bool(has_image.all()) else None)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(accelerator, kind: str) -> tuple[dict, dict]:
    """(initial, final) full weights of one run of the ordinary loop."""
    torch.manual_seed(0)
    model = mixtral() if kind == "mixtral" else TinyVLM()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(dataset(kind), batch_size=ROWS)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        loss = loss_of(kind, model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    state = accelerator.unwrap_model(model).state_dict()  # the user's way, on both sides (ZeRO: gathered)
    return initial, {k: v.detach().float().clone() for k, v in state.items()}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    stock = accelerate.Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    reference = {kind: train(stock, kind) for kind in ("mixtral", "vlm")}
    # the oracle trained every part: the experts, and the projector on the image steps
    report: dict = {"stock_moved": {f"{kind}:{name}": float((final[name] - initial[name].float()).abs().max())
                                    for kind, (initial, final) in reference.items() for name in final}}

    def run(case):
        acc = ZeroAccelerator(case["preset"])
        _, final = train(acc, case["model"])
        acc.free_memory()
        worst, name = worst_rel_diff(final, reference[case["model"]][1])
        return {"case": case, "weight_rel_diff": worst, "worst": name}

    report["zero"] = run_cases([{"model": m, "preset": p} for m in ("mixtral", "vlm") for p in PRESETS], run)
    finish(out, report)


if __name__ == "__main__":
    main()
