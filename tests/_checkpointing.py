"""Gradient checkpointing tests' shared parts: the cases, one launch of
workers/grad_checkpointing.py on 2 ranks (read by the parity and the communication
tests), and the plain model that calls ``torch.utils.checkpoint`` around its blocks."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from _launch import launch
from _models import TinyLM

CKPTS = (None, "non_reentrant", "reentrant")
CASES = (
    # torch.utils.checkpoint around each block (hooks inside the region), once and twice per iteration
    [dict(model="torch", base=b, stage=s, ckpt=c, calls=n)
     for b in ("full", "frozen") for s in (1, 2, 3) for c in CKPTS for n in (1, 2)]
    # HF gradient_checkpointing_enable (hooks outside the region), full fine-tune and LoRA
    + [dict(model="llama", base=b, stage=s, ckpt=c, calls=1) for b in ("full", "lora") for s in (1, 2, 3) for c in CKPTS]
    + [dict(model="llama", base=b, stage=3, ckpt=c, calls=2) for b in ("full", "lora") for c in CKPTS]
)


class CheckpointedLM(TinyLM):
    """TinyLM whose blocks run under ``torch.utils.checkpoint`` (``reentrant`` None: not at all)."""

    def __init__(self, reentrant: bool | None):
        super().__init__(layers=3)
        self.reentrant = reentrant

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + h @ self.frozen_mix
        if torch.is_grad_enabled() and not h.requires_grad:
            # what HF's enable_input_require_grads does: reentrant checkpointing only
            # back-propagates through regions whose inputs require grad
            h.requires_grad_()
        for block in self.layers:
            h = block(h) if self.reentrant is None else checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(self.final_norm(h))


def key(case: dict) -> tuple:
    return (case["model"], case["base"], case["stage"], case["ckpt"], case["calls"])


def case_id(case: dict) -> str:
    return f"{case['model']}-{case['base']}-stage{case['stage']}-{case['ckpt'] or 'no_ckpt'}-calls{case['calls']}"


@functools.lru_cache(maxsize=None)
def _reports() -> tuple:
    """Each rank's report, launched once per session (a failing case is cached too, so the
    other tests read it instead of relaunching)."""
    return tuple(launch("grad_checkpointing.py", 2, {"cases": CASES}, timeout=300))


def results_of(case: dict) -> list[dict]:
    """The case's result on each rank; fails with the worker's traceback if it raised."""
    found = []
    for rank, rep in enumerate(_reports()):
        by_key = {key(r["case"]): r for r in rep["results"]}
        res = by_key.get(key(case))
        if res is None:
            errors = [r["error"] for r in rep["results"] if "error" in r]
            raise AssertionError(f"rank {rank} has no result for {case}; the worker stopped at:\n"
                                 + (errors[0] if errors else "(no error reported)"))
        assert "error" not in res, res["error"]
        found.append(res)
    return found
