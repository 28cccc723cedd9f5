"""A refused ``load_checkpoint`` changes nothing, on every rank: the user who catches the error
and trains on trains the model they had (issue 38, item 1; SECURITY.md).

Before, each file was verified when first opened, in the middle of copying: with the file
read last damaged (another rank's file loaded at another world size, the buffers, the extra
state), the masters and the optimizer state were already partly the checkpoint's when the
load raised; on 2 ranks with rank 1's file damaged, rank 0 had loaded everything. Now every
file a rank will read is verified, and every check done, on every rank, and the ranks agree,
before the first value is copied.

Each case compares every weight (fp32 masters), buffer, optimizer-state entry, hyperparameter
and the loss scaler before and after the refused load, and then the next training step with
a run that never tried the load (bit for bit).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import zero_strategy as zs
from _launch import launch
from _models import TinyLM, param_groups
from _refused_load import build, damaged_copy, differences, snapshot, train_step


def _save(path, model, opt):
    for step in (10, 11):
        train_step(model, opt, 0, step)
    zs.save_checkpoint(path, model, opt, extra_state={"tensor": torch.ones(2)})
    return path


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("refused") / "ckpt", *build(seed=1))


def _trained_after_refusal(path, match: str, stage: int = 2):
    """Train a step, try the load (it must raise ``match``), train on; the changed entries and
    whether the next step equals a run that never tried the load."""
    model, opt = build(stage)
    train_step(model, opt, 0, 0)
    before = snapshot(model, opt)
    with pytest.raises(zs.CheckpointError, match=match):
        zs.load_checkpoint(path, model, opt)
    changed = differences(before, snapshot(model, opt))
    loss = train_step(model, opt, 0, 1)
    weights = zs.full_state_dict(model, dtype=None)
    ref_model, ref_opt = build(stage)
    train_step(ref_model, ref_opt, 0, 0)
    ref_loss = train_step(ref_model, ref_opt, 0, 1)
    ref = zs.full_state_dict(ref_model, dtype=None)
    return changed, loss == ref_loss and all(torch.equal(weights[k], v) for k, v in ref.items())


@pytest.mark.parametrize("file", ["buffers.safetensors", "extra_state.pt"])
def test_a_damaged_file_read_after_the_shards_changes_nothing(file, intact, tmp_path):
    damaged = damaged_copy(intact, tmp_path / "ckpt", file)
    changed, trains_on = _trained_after_refusal(damaged, f"{file} is corrupted")
    assert changed == [], f"a refused load changed {len(changed)} entries: {changed[:8]}"
    assert trains_on


def test_a_buffer_of_another_shape_is_refused_before_anything_is_copied(intact):
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    model.register_buffer("counts", torch.arange(5.0))
    model, opt = zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(stage=2))
    before = snapshot(model, opt)
    with pytest.raises(zs.CheckpointError, match=r"buffer counts: checkpoint shape \(4,\), model \(5,\)"):
        zs.load_checkpoint(intact, model, opt)
    assert differences(before, snapshot(model, opt)) == []


def test_a_parameter_frozen_in_the_checkpoint_is_refused_before_anything_is_copied(tmp_path):
    """Its missing optimizer state was found while loading its group, after the groups before it."""
    torch.manual_seed(1)
    model = TinyLM(layers=2)
    model.register_buffer("counts", torch.arange(4.0))
    model.layers[1].fc2.weight.requires_grad_(False)
    saved = _save(tmp_path / "ckpt", *zs.setup(model, torch.optim.AdamW(param_groups(model)),
                                              zs.ZeroConfig(stage=2)))
    model, opt = build()
    train_step(model, opt, 0, 0)
    before = snapshot(model, opt)
    with pytest.raises(zs.CheckpointError, match=r"layers\.1\.fc2\.weight is trainable here but was frozen in "
                                                 r"the checkpoint"):
        zs.load_checkpoint(saved, model, opt)
    assert differences(before, snapshot(model, opt)) == []


# ------------------------------------------------------------------ two ranks
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("refused2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reports = launch("refused_load.py", 2, {"dir": str(root)}, timeout=240)
    return root, [r["results"] for r in reports]


CASES = [f"z{stage}-{damage}" for stage in (2, 3) for damage in ("rank1_file", "buffers", "extra_state")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_refuse_and_change_nothing_on_any_rank(case, two_ranks):
    """Rank 1's file damaged: rank 0's own file is intact, and it loaded all of it before."""
    _, results = two_ranks
    file = {"rank1_file": "rank00001-of-00002", "buffers": "buffers", "extra_state": "extra_state"}[
        case.split("-", 1)[1]]
    for rank, res in enumerate(results):
        got = res[case]
        assert f"{file}" in got["message"] and "is corrupted" in got["message"], (rank, got["message"])
        assert got["changed"] == [], f"rank {rank}: a refused load changed {got['changed'][:8]}"
        assert got["trains_on_as_if_never_loaded"], f"rank {rank}"
    assert results[0][case]["message"] == results[1][case]["message"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_the_intact_two_rank_checkpoint_loads(stage, two_ranks):
    """The control: the same checkpoint undamaged loads, and changes the state."""
    _, results = two_ranks
    for res in results:
        assert res[f"z{stage}-intact"]["message"] == "loaded"
        assert res[f"z{stage}-intact"]["changed"]


@pytest.mark.multiprocess
def test_a_two_rank_checkpoint_with_rank_1_damaged_changes_nothing_on_one_rank(two_ranks):
    """At another world size one rank reads both files: rank 0's first, then rank 1's."""
    root, _ = two_ranks
    changed, trains_on = _trained_after_refusal(root / "rank1_file", r"rank00001-of-00002\.safetensors is corrupted")
    assert changed == [], f"a refused load changed {len(changed)} entries: {changed[:8]}"
    assert trains_on
