"""Errors a ZeroAccelerator raises once Accelerate is set up (one process, plain ``python``).

Each case is caught and its type and message reported; the test checks them. The
cases share one process because Accelerate's state is a per-process singleton.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from _models import TinyLM, param_groups  # noqa: E402

from zero_strategy.accelerate import ZeroAccelerator  # noqa: E402


def attempt(fn) -> dict:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": ""}


class _Counter:
    """An object Accelerate saves and restores itself (``register_for_checkpointing``)."""

    def __init__(self):
        self.value = 0

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]


def _refused_load_state(acc, pairs, out: Path, report: dict) -> None:
    """``load_state`` of a directory whose second ZeRO model's file is damaged: before, Accelerate's
    objects and the first model were restored when the second refused; now nothing is."""
    from _refused_load import differences, flip_a_byte, snapshot

    counter = _Counter()
    acc.register_for_checkpointing(counter)
    acc.save_state(str(out / "state"))
    counter.value = 5
    for m, o in pairs:  # the state moves on past the checkpoint
        acc.backward(m(torch.randint(0, 37, (2, 8))).float().pow(2).mean())
        o.step()
        o.zero_grad()
    before = [snapshot(m, o) for m, o in pairs]
    flip_a_byte(out / "state" / "zero_model_1" / "rank00000-of-00001.safetensors")
    report["refused_load_state"] = attempt(lambda: acc.load_state(str(out / "state")))
    report["refused_load_state_changed"] = [differences(b, snapshot(m, o)) for b, (m, o) in zip(before, pairs)]
    report["refused_load_state_counter"] = counter.value


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    report: dict = {}
    acc = ZeroAccelerator({"stage": 3, "param_persistence_threshold": 0})  # every parameter sharded
    report["default_precision"] = acc.zero_config.precision
    model = TinyLM()
    opt = torch.optim.AdamW(param_groups(model))
    model, opt = acc.prepare(model, opt)
    report["prepared_twice"] = attempt(lambda: acc.prepare(model))
    report["prepared_twice_with_optimizer"] = attempt(
        lambda: acc.prepare(model, torch.optim.AdamW(model.parameters())))

    stray = TinyLM()
    report["optimizer_without_model"] = attempt(lambda: acc.prepare(torch.optim.SGD(stray.parameters(), lr=0.1)))

    def subset_clip():
        loss = model(torch.randint(0, 37, (2, 8))).float().pow(2).mean()
        acc.backward(loss)
        acc.clip_grad_norm_(list(model.layers[0].parameters()), 1.0)
    report["clip_subset"] = attempt(subset_clip)
    report["precision_conflict"] = attempt(lambda: ZeroAccelerator({"stage": 2, "precision": "bf16"}))

    # a model prepared before its optimizer is sharded when the optimizer comes
    late = TinyLM()
    late = acc.prepare(late)
    report["pending_before_optimizer"] = len(acc.pending_models)
    report["save_state_while_pending"] = attempt(lambda: acc.save_state(str(out / "pending")))
    late_opt = acc.prepare(torch.optim.AdamW(late.parameters()))
    report["pending_after_optimizer"] = len(acc.pending_models)
    report["late_is_zero"] = acc.is_zero_model(late)
    report["late_optimizer"] = type(late_opt).__name__

    _refused_load_state(acc, [(model, opt), (late, late_opt)], out, report)

    acc.free_memory()
    report["after_free_is_zero"] = acc.is_zero_model(model)
    report["after_free_param_shape"] = list(model.layers[0].fc1.weight.shape)
    report["after_free_all_nan"] = all(bool(p.isnan().all()) for p in model.parameters())  # released, not gathered
    report["stale_optimizer"] = attempt(lambda: acc.prepare(model, opt))

    kept = TinyLM()
    want = {k: v.clone() for k, v in kept.state_dict().items()}  # the weights before prepare
    kept = acc.prepare(kept)
    acc.free_memory(keep_weights=True)  # asked for: gathered back whole
    report["kept_is_zero"] = acc.is_zero_model(kept)
    report["kept_max_diff"] = max((kept.state_dict()[k] - v).abs().max().item() for k, v in want.items())
    (out / "rank0.json").write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
