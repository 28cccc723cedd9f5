"""One launch of workers/grad_checkpointing.py on 2 ranks, shared by the parity and the
communication tests of gradient checkpointing."""

from __future__ import annotations

import functools

from _launch import launch

CKPTS = (None, "non_reentrant", "reentrant")
CASES = (
    # torch.utils.checkpoint around each block (hooks inside the region), once and twice per iteration
    [dict(model="torch", base=b, stage=s, ckpt=c, calls=n)
     for b in ("full", "frozen") for s in (1, 2, 3) for c in CKPTS for n in (1, 2)]
    # HF gradient_checkpointing_enable (hooks outside the region), full fine-tune and LoRA
    + [dict(model="llama", base=b, stage=s, ckpt=c, calls=1) for b in ("full", "lora") for s in (1, 2, 3) for c in CKPTS]
    + [dict(model="llama", base=b, stage=3, ckpt=c, calls=2) for b in ("full", "lora") for c in CKPTS]
)


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
