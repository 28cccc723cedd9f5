"""``zero-strategy export CKPT_DIR OUT --format dcp``: our checkpoint as a torch.distributed.checkpoint
directory, judged by DCP's own reader (``dcp_to_torch_save``), not by ours.

A one-process zero2 run of TinyLM (tied weights, a frozen parameter, two AdamW param groups) trains
two steps and saves; the export must hold every entry of the model's state dict as our run holds
it, and the AdamW state and param groups as a plain torch AdamW that trained the same two steps
holds them (1e-6 relative: one process, the same sums; measured 0). FSDP2 resuming such an export
is tests/test_dcp_checkpoint.py's concern.
"""

from __future__ import annotations

import re

import pytest
import torch

from _compare import worst_rel_diff
from _models import TinyLM, batch, loss_fn, param_groups

TOL = 1e-6


def _train(model, opt, backward_step) -> None:
    for step in range(2):
        tokens, targets = batch(0, step, 0)
        backward_step(loss_fn(model(tokens), targets))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import zero_strategy as zs

    torch.manual_seed(3)
    model = TinyLM(layers=2)
    reference = TinyLM(layers=2)
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.AdamW(param_groups(reference), betas=(0.9, 0.95))
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95)),
                           zs.ZeroConfig(stage=2, precision="fp32", param_persistence_threshold=0))
    _train(model, zopt, lambda loss: (zopt.backward(loss), zopt.step(), zopt.zero_grad()))
    _train(reference, ref_opt, lambda loss: (loss.backward(), ref_opt.step(), ref_opt.zero_grad()))
    ckpt = tmp_path_factory.mktemp("export") / "ckpt"
    zs.save_checkpoint(ckpt, model, zopt)
    return ckpt, zs.full_state_dict(model, dtype=None), reference, ref_opt


def _read_with_dcp(path, tmp_path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp_path / "whole.pt")
    return torch.load(tmp_path / "whole.pt", weights_only=True)


def test_export_writes_model_and_adamw_state_as_dcp(saved, tmp_path, capsys):
    from zero_strategy.cli import main

    ckpt, weights, reference, ref_opt = saved
    out = tmp_path / "dcp"
    assert main(["export", str(ckpt), str(out), "--format", "dcp"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    whole = _read_with_dcp(out, tmp_path)

    assert sorted(whole["model"]) == sorted(weights)
    for k, want in weights.items():
        assert torch.equal(whole["model"][k], want), k

    names = {id(p): n for n, p in reference.named_parameters()}
    for p, want in ref_opt.state.items():
        got = whole["optim"]["state"][names[id(p)]]
        assert sorted(got) == sorted(want), names[id(p)]
        assert float(got["step"]) == float(want["step"]) == 2.0
        worst, where = worst_rel_diff({k: got[k] for k in ("exp_avg", "exp_avg_sq")},
                                      {k: want[k] for k in ("exp_avg", "exp_avg_sq")})
        assert worst < TOL, f"{names[id(p)]}: {where} differs by {worst:.2e}"
    groups = whole["optim"]["param_groups"]
    for saved_pg, want in zip(groups.values() if isinstance(groups, dict) else groups, ref_opt.param_groups):
        assert sorted(saved_pg["params"]) == sorted(names[id(p)] for p in want["params"])
        assert (saved_pg["lr"], saved_pg["weight_decay"], tuple(saved_pg["betas"])) == \
            (want["lr"], want["weight_decay"], want["betas"])


def test_export_refuses_an_existing_output_in_one_line(saved, tmp_path, capsys):
    from zero_strategy.cli import main

    ckpt = saved[0]
    (tmp_path / "taken").mkdir()
    assert main(["export", str(ckpt), str(tmp_path / "taken"), "--format", "dcp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zero-strategy export: error: output path") and "exists" in err
    assert err.count("\n") == 1


def test_export_names_the_formats_it_writes(saved, tmp_path, capsys):
    from zero_strategy.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["export", str(saved[0]), str(tmp_path / "out"), "--format", "megatron"])
    assert exit_.value.code == 2
    assert re.search(r"invalid choice: 'megatron' \(choose from '?dcp'?, '?deepspeed-universal'?\)",
                     capsys.readouterr().err)
