"""An optimizer the script never passes to ``accelerator.prepare``, stock Accelerate vs ZeroAccelerator.

The loop is the Accelerate quick tour's (``accelerator.prepare(...)``,
``optimizer.zero_grad()``, ``accelerator.backward(loss)``, ``optimizer.step()``), with
the optimizer left out of ``prepare``: under stock Accelerate the model is DDP-wrapped
and the raw optimizer still trains identical replicas. Cases, in one process each rank:

* ``stock``: stock ``accelerate.Accelerator`` (DDP), the optimizer not prepared;
* ``zero_unprepared``: the same script with ZeroAccelerator (must raise, with the fix);
* ``zero_plain_backward``: the same, with ``loss.backward()`` instead of ``accelerator.backward``;
* ``zero_fixed``: the script as the error message says to write it (optimizer prepared);
* ``zero_late``: the model prepared first, the optimizer built over its parameters and
  prepared afterwards (the order Accelerate's FSDP docs teach): sharded then, trains;
* ``zero_forward_only``: a model prepared alone and only evaluated (no backward): no error.

Each case reports the flattened final weights (or the error), for the test to compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _models import VOCAB, TinyLM  # noqa: E402
from _worker import finish  # noqa: E402

import accelerate  # noqa: E402
import zero_strategy as zs  # noqa: E402
from zero_strategy.accelerate import Accelerator as ZeroAccelerator  # noqa: E402

ROWS_PER_PROCESS, STEPS = 4, 4


def dataset():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (ROWS_PER_PROCESS * 2 * STEPS, 9), generator=g)


def loss_function(logits, tokens):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(accelerator, prepare_optimizer: bool, use_accelerator_backward: bool = True, late: bool = False):
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    training_dataloader = torch.utils.data.DataLoader(dataset(), batch_size=ROWS_PER_PROCESS)
    if late:
        model, training_dataloader = accelerator.prepare(model, training_dataloader)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    elif prepare_optimizer:
        model, optimizer, training_dataloader = accelerator.prepare(model, optimizer, training_dataloader)
    else:
        model, training_dataloader = accelerator.prepare(model, training_dataloader)
    for tokens in training_dataloader:
        optimizer.zero_grad()
        loss = loss_function(model(tokens[:, :-1]), tokens)
        if use_accelerator_backward:
            accelerator.backward(loss)
        else:
            loss.backward()
        optimizer.step()
    return model


def weights(accelerator, model) -> list[float]:
    if getattr(accelerator, "is_zero_model", lambda m: False)(model):
        state = zs.full_state_dict(model)
    else:
        state = accelerator.unwrap_model(model).state_dict()
    return torch.cat([v.detach().float().flatten() for _, v in sorted(state.items())]).tolist()


def attempt(fn) -> dict:
    try:
        return {"weights": fn(), "error": None}
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"weights": None, "error": type(err).__name__, "message": str(err)}


def forward_only(accelerator) -> list[float]:
    torch.manual_seed(0)
    model = accelerator.prepare(TinyLM())
    with torch.no_grad():
        logits = model(dataset()[:2, :-1])
    return [float(logits.abs().sum())]


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    stock = accelerate.Accelerator()
    torch.manual_seed(0)
    report = {"initial": weights(stock, TinyLM()),
              "stock": attempt(lambda: weights(stock, train(stock, prepare_optimizer=False)))}
    zero = ZeroAccelerator("zero2")
    report["zero_unprepared"] = attempt(lambda: weights(zero, train(zero, prepare_optimizer=False)))
    report["zero_plain_backward"] = attempt(
        lambda: weights(zero, train(zero, prepare_optimizer=False, use_accelerator_backward=False)))
    report["zero_fixed"] = attempt(lambda: weights(zero, train(zero, prepare_optimizer=True)))
    report["zero_late"] = attempt(lambda: weights(zero, train(zero, prepare_optimizer=True, late=True)))
    report["zero_forward_only"] = attempt(lambda: forward_only(zero))
    report["num_processes"] = zero.num_processes
    torch.distributed.barrier()
    finish(out, report)


if __name__ == "__main__":
    main()
