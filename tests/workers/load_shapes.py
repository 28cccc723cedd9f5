"""``zs.load_full_state_dict`` with one tensor of another shape, on every rank: report each rank's
message and what the refused load changed (stages 2 and 3; args["cases"] name the damages of
tests/test_load_shapes.py)."""

from __future__ import annotations

import torch

import zero_strategy as zs
from _refused_load import differences, snapshot
from _worker import finish, start

SHAPES = {
    "transposed": lambda t: t.t().contiguous(),
    "flat_same_numel": lambda t: t.reshape(-1),
    "too_small": lambda t: t.reshape(-1)[:100],
    "too_large": lambda t: torch.cat([t, t]),
}


def main() -> None:
    args, out = start()
    from _models import TinyLM, param_groups

    results = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        model = TinyLM(layers=2)
        model.register_buffer("counts", torch.arange(4.0))
        model, opt = zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(stage=stage))
        for case in args["cases"]:
            sd = {k: v + 1 for k, v in zs.full_state_dict(model).items()}
            sd[args["weight"]] = SHAPES[case](sd[args["weight"]])
            before = snapshot(model, opt)
            try:
                zs.load_full_state_dict(model, sd)
                message = "loaded"
            except zs.CheckpointError as err:
                message = str(err)
            results[f"z{stage}-{case}"] = {"message": message, "changed": differences(before, snapshot(model, opt))}
        zs.teardown(model, keep_weights=False)
    finish(out, {"results": results})


if __name__ == "__main__":
    main()
