"""What the DeepSpeed-import tests share (tests/test_deepspeed_checkpoint_import.py and the NVMe and
Lightning ones beside it): the fp32 tolerance of a resume against DeepSpeed continuing its own run,
and a tiny set-up model with a snapshot of its weights and optimizer state, to show a refused load
changed nothing. No launches are cached here, so each module's DeepSpeed runs go to their own
pytest worker (tests/conftest.py, shared_launch_scope)."""

from __future__ import annotations

import torch

#: fp32 resumes: measured 0 on 2 ranks, 1e-7 on 1 rank (the same sums in another order)
FP32_TOL = 1e-5


def results_by_name(reports: list[dict]) -> dict[str, list[dict]]:
    """Every rank's result of a ``run_cases`` worker's launch, by case name, in rank order."""
    by_name: dict[str, list[dict]] = {}
    for rep in reports:
        for res in rep["results"]:
            by_name.setdefault(res["name"], []).append(res)
    return by_name


def finished_on_every_rank(by_name: dict[str, list[dict]], name: str, world: int) -> list[dict]:
    """Case ``name``'s result from each of the ``world`` ranks, none of them an error."""
    results = by_name.get(name, [])
    for res in results:
        assert "error" not in res, res["error"]
    assert len(results) == world, f"{name} finished on {len(results)} of {world} ranks"
    return results


def deepspeed_runs_succeeded(reports: list[dict], what: str) -> None:
    """A fixture's DeepSpeed runs all finished: otherwise every test that resumes them would fail on a
    missing directory, far from the cause; this fails with DeepSpeed's own traceback."""
    errors = [res["error"] for rep in reports for res in rep["results"] if "error" in res]
    assert not errors, f"{what} failed, so there is nothing to resume:\n{errors[0]}"


def setup_tiny():
    import zero_strategy as zs
    from _models import TinyLM, param_groups

    torch.manual_seed(0)
    model = TinyLM(layers=2)
    opt = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))
    return zs.setup(model, opt, zs.ZeroConfig(stage=2, param_persistence_threshold=0))


def snapshot(model, zopt) -> dict:
    import zero_strategy as zs
    return {"weights": zs.full_state_dict(model, dtype=None),
            "state": {k: v.clone() if torch.is_tensor(v) else v for st in zopt.optimizer.state.values()
                      for k, v in st.items()},
            "lr": [pg["lr"] for pg in zopt.optimizer.param_groups]}


def same(a: dict, b: dict) -> bool:
    return (all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]) and a["lr"] == b["lr"]
            and a["state"].keys() == b["state"].keys()
            and all(torch.equal(v, b["state"][k]) if torch.is_tensor(v) else v == b["state"][k]
                    for k, v in a["state"].items()))
