"""A training script as Accelerate's docs write it, launched with a DeepSpeed user's accelerate config.

The one line that differs from a DeepSpeed user's script is the import (args.json
``front``): ``zero`` imports ``from zero_strategy.accelerate import Accelerator``,
``stock`` ``from accelerate import Accelerator`` (the DDP oracle, launched with the
shipped MULTI_GPU CPU config and the accumulation DeepSpeed would use). Everything
else (accumulation steps, ZeRO stage, offload, clipping) comes from the launch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _models import VOCAB, TinyLM  # noqa: E402
from _worker import finish  # noqa: E402

import zero_strategy as zs  # noqa: E402

ROWS_PER_PROCESS, MICRO_BATCHES = 2, 8


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    if args["front"] == "zero":
        from zero_strategy.accelerate import Accelerator
    else:
        from accelerate import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.5 * s))
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, VOCAB, (ROWS_PER_PROCESS * 2 * MICRO_BATCHES, 9), generator=g)
    loader = torch.utils.data.DataLoader(data, batch_size=ROWS_PER_PROCESS)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    norms = []
    for tokens in loader:
        with accelerator.accumulate(model):
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    zero = getattr(accelerator, "zero_config", None)
    state = zs.full_state_dict(model) if zero is not None else accelerator.unwrap_model(model).state_dict()
    report = {
        "distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
        "gradient_accumulation_steps": accelerator.gradient_accumulation_steps, "norms": norms,
        "weights": torch.cat([v.detach().float().flatten() for _, v in sorted(state.items())]).tolist(),
        "zero_config": None if zero is None else {
            "stage": zero.stage, "precision": zero.precision, "gradient_clipping": zero.gradient_clipping,
            "offload_optimizer": None if zero.offload_optimizer is None else zero.offload_optimizer.device,
            "offload_params": None if zero.offload_params is None else zero.offload_params.device},
    }
    finish(out, report)


if __name__ == "__main__":
    main()
