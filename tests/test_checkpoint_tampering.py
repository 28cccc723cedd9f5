"""A damaged or edited checkpoint is refused before anything is read, with a message naming the
file, the entry and the problem: by load_checkpoint on 1 and on 2 ranks (same message on
every rank) and by consolidate (leaving no output behind).

The table of damages and their expected messages is tests/_tamper.py. Before, edits that
stayed valid JSON (swapped offsets or names, a changed digit, a wrong dtype, lr NaN,
``"params": [1]``, ``../../x`` as a file name) loaded wrong weights silently or read
outside the checkpoint.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import zero_strategy as zs
from _launch import launch
from _refused_load import differences, snapshot
from _tamper import CASES, read_meta, save_intact, tiny, write_meta

CONSOLIDATE_CASES = [c for c in CASES if c.consolidate_message is not None]


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    return save_intact(tmp_path_factory.mktemp("intact") / "ckpt")


def test_intact_checkpoint_loads_the_saved_values_and_consolidates(intact, tmp_path):
    """The control: the same checkpoint, undamaged, loads (weights equal the saved model's)."""
    saved, _ = tiny()
    saved(torch.randint(0, 37, (2, 8)))  # same construction as save_intact, before its step
    model, opt = tiny()
    extra = zs.load_checkpoint(intact, model, opt)
    assert torch.equal(extra["tensor"], torch.ones(2))
    full = zs.full_state_dict(model)
    assert not torch.equal(full["embed.weight"], zs.full_state_dict(saved)["embed.weight"])  # it stepped
    out = zs.checkpoint.consolidate(intact, tmp_path / "out")
    from safetensors.torch import load_file

    consolidated = load_file(out / "model.safetensors")
    assert all(torch.equal(consolidated[k], full[k]) for k in full)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_load_refuses_and_changes_nothing(case, intact, tmp_path):
    damaged = case.apply(intact, tmp_path / "ckpt")
    model, opt = tiny()
    model(torch.randint(0, 37, (2, 8))).float().mean().backward()
    opt.step()  # optimizer state of its own, which a load would replace
    before = snapshot(model, opt)
    with pytest.raises(zs.CheckpointError, match=case.load):
        zs.load_checkpoint(damaged, model, opt)
    changed = differences(before, snapshot(model, opt))
    assert changed == [], f"a refused load changed {changed[:8]}"


@pytest.mark.parametrize("case", CONSOLIDATE_CASES, ids=[c.id for c in CONSOLIDATE_CASES])
def test_consolidate_refuses_and_leaves_nothing(case, intact, tmp_path):
    damaged = case.apply(intact, tmp_path / "ckpt")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(zs.CheckpointError, match=case.consolidate_message):
        zs.checkpoint.consolidate(damaged, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_unknown_optimizer_field_is_not_restored(intact, tmp_path):
    """Only fields the running optimizer has are restored; others are named in a warning."""
    damaged = tmp_path / "ckpt"
    import shutil

    shutil.copytree(intact, damaged)
    meta = read_meta(damaged)
    meta["optimizers"][0]["param_groups"][0]["evil_hook"] = "os.system"
    meta["optimizer"] = meta["optimizers"][0]
    write_meta(damaged, meta)
    model, opt = tiny()
    with pytest.warns(UserWarning, match=r"optimizer fields \['evil_hook'\] are not fields of the running AdamW; "
                                         r"not restored"):
        zs.load_checkpoint(damaged, model, opt)
    assert all("evil_hook" not in pg for pg in opt.param_groups)


@pytest.fixture(scope="module")
def two_rank_results(intact, tmp_path_factory):
    root = tmp_path_factory.mktemp("tampered")
    paths = {c.id: str(c.apply(intact, root / c.id)) for c in CASES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return launch("checkpoint_tamper.py", 2, {"paths": paths}, timeout=180)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_two_ranks_refuse_with_the_same_message(case, two_rank_results):
    messages = [r["results"][case.id] for r in two_rank_results]
    assert messages[0] == messages[1], messages
    assert re.search(case.load, messages[0]), messages[0]
