"""A save killed midway never costs the previous checkpoint; non-checkpoint paths are refused.

The kill is real: the worker ranks ``os._exit`` inside the streaming file writer
(after part of their rank file is on disk) or right after the previous checkpoint
was moved aside (between the two renames of the swap).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import zero_strategy as zs
from zero_strategy.checkpoint._owned import SAVE_PREFIX
from _launch import launch, launch_faulty
from _models import TinyLM, param_groups


def _tiny(stage: int = 2):
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    return zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(stage=stage))


def _assert_loads_as(path, sd_file) -> None:
    model, opt = _tiny()
    extra = zs.load_checkpoint(path, model, opt)
    assert extra == {"next_step": 1}
    want = torch.load(sd_file)
    got = zs.full_state_dict(model, dtype=None)
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _crashed_second_save(tmp_path, crash: str, stage: int, nproc: int):
    """Train 2 steps saving to ``<tmp_path>/ckpt`` after each; the second save is killed at ``crash``."""
    path = tmp_path / "ckpt"
    case = dict(name="crash", stage=stage, precision="fp32", start=0, end=2, save={"1": str(path), "2": str(path)},
                crash=crash, sd_at_save=str(tmp_path / "sd"))
    launch("checkpoint.py", nproc, {"cases": [case]}, timeout=120)
    return path


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_peer_killed_while_writing_leaves_the_previous_checkpoint_and_no_partial_one(tmp_path):
    """Only rank 1 dies mid-write; rank 0 must not hang in the save's agreement, must not publish
    the half-written checkpoint, and must remove its temporary directory (issue #15)."""
    path = tmp_path / "ckpt"
    case = dict(name="crash", stage=3, precision="fp32", start=0, end=2, save={"1": str(path), "2": str(path)},
                crash="peer_write", sd_at_save=str(tmp_path / "sd"))
    (tmp_path / "run").mkdir()
    result = launch_faulty("checkpoint.py", 2, {"cases": [case]}, survivors=[0], out=tmp_path / "run", timeout=150)
    assert result["codes"][1] == -9, "rank 1 was not killed mid-save"
    assert result["exited"][0] is not None, result["logs"][0]
    error = result["reports"][0]["results"][-1].get("error", "")
    assert "CollectiveError" in error and "Group ranks 1 reported nothing" in error, error
    assert not list(tmp_path.glob(f"{SAVE_PREFIX}*")), "the partial checkpoint directory was left behind"
    _assert_loads_as(path, tmp_path / "sd-1.pt")  # intact: the previous one, bit for bit


@pytest.mark.multiprocess
def test_rank_killed_while_writing_keeps_previous_checkpoint(tmp_path):
    path = _crashed_second_save(tmp_path, "write", stage=2, nproc=2)
    leftovers = list(tmp_path.glob(f"{SAVE_PREFIX}*"))
    assert leftovers, "the second save was not interrupted"
    assert not (leftovers[0] / "metadata.json").exists()
    assert any(leftovers[0].glob("rank*.safetensors")), "the kill came before any shard was written"
    _assert_loads_as(path, tmp_path / "sd-1.pt")
    # the next save cleans up what the killed one left
    model, opt = _tiny()
    zs.save_checkpoint(path, model, opt)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("ckpt", SAVE_PREFIX))) == ["ckpt"]


@pytest.mark.multiprocess
def test_killed_between_renames_loads_previous_checkpoint(tmp_path):
    path = _crashed_second_save(tmp_path, "rename", stage=3, nproc=1)
    assert not path.exists() and list(tmp_path.glob("ckpt.old-*")), "the save was not killed between renames"
    with pytest.warns(UserWarning, match="interrupted save"):
        _assert_loads_as(path, tmp_path / "sd-1.pt")


def test_existing_file_is_refused(tmp_path):
    model, opt = _tiny()
    target = tmp_path / "weights.bin"
    target.write_bytes(b"not ours")
    with pytest.raises(zs.CheckpointError, match="weights.bin.*not a checkpoint directory"):
        zs.save_checkpoint(target, model, opt)
    assert target.read_bytes() == b"not ours"


def test_existing_foreign_directory_is_refused(tmp_path):
    model, opt = _tiny()
    target = tmp_path / "results"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(zs.CheckpointError, match="results.*not a zero_strategy checkpoint"):
        zs.save_checkpoint(target, model, opt)
    assert (target / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # no temporary directory left


def test_save_replaces_previous_checkpoint(tmp_path):
    model, opt = _tiny()
    zs.save_checkpoint(tmp_path / "c", model, opt, extra_state={"n": 1})
    zs.save_checkpoint(tmp_path / "c", model, opt, extra_state={"n": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    model2, opt2 = _tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zs.load_checkpoint(tmp_path / "c", model2, opt2) == {"n": 2}
