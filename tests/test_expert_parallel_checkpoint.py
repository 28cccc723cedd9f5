"""Resuming an expert-parallel run from a sharded checkpoint (tests/workers/expert_parallel_checkpoint.py,
and tests/workers/accelerate_expert_parallel.py for ZeroAccelerator.save_state/load_state).

A tiny transformers 5 Mixtral (4 experts) at stage 3 with ``expert_parallel_size=2`` on 2 ranks,
each rank on its own half of the batch (routing differs by rank), trains 2 steps and saves with
``zero_strategy.checkpoint.save_checkpoint``; a new launch (fresh processes, fresh process group)
builds the model from another seed, loads, and trains 2 more steps. Against an uninterrupted
expert-parallel run of 4 steps the losses and the final full weights are bit for bit equal, and
against one process training on the whole batch they are equal within fp32 tolerance. The same
checkpoint resumes on 4 ranks with ``expert_parallel_size=2`` (two replica groups) and
``expert_parallel_size=4`` (one expert per rank): each rank reads its experts by their global
index, from whichever file holds them; so does a resume at stage 1 on 2 ranks. An asynchronous
save writes the same checkpoint.

Into a model set up without expert parallelism (the experts sharded as any parameter) the weights
load, equal to the saving run's. Refused, with the model left as it was on every rank: a tampered
or a missing experts file (only rank 1 reads it; the ranks agree), the optimizer state of the
checkpoint into a model without expert parallelism, a checkpoint saved without it loaded into an expert-parallel model, and ``save_dcp`` of an
expert-parallel model.

``optimizer.state_dict()`` holds the experts' optimizer state too (``"expert_parallel"``): cleared
and restored by ``load_state_dict``, training goes on exactly as the uninterrupted run; a state
dict of another ``expert_parallel_size`` is refused. A forged ``experts`` entry of the metadata (its
checksum recomputed) is refused by the metadata's checks or the experts file's header.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _launch import launch_cases  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOL = 1e-5
REFUSED = {
    "tamper": "sha256",
    "missing": "experts00001-of-00002.safetensors",
    "into_dense": "only its weights load yet: pass optimizer=None",
    "dense_into_ep": "was saved without expert parallelism",
    "dcp": "save_dcp does not write the rank-local experts",
}


def _launch(world: int, cases: list[dict]):
    return launch_cases("expert_parallel_checkpoint.py", world, cases, key=lambda r: r["case"], timeout=300)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("epckpt")


@pytest.fixture(scope="module")
def runs(base):
    """Launch 1 saves (sync and async); launch 2 resumes on 2 ranks; launch 3 on 4 ranks."""
    path = base
    ckpt, async_ckpt = str(path / "ckpt"), str(path / "ckpt-async")
    first = _launch(2, [dict(case="reference", kind="reference", ep=2),
                        dict(case="save", kind="save", ep=2, path=ckpt),
                        dict(case="save-async", kind="save", ep=2, path=async_ckpt, async_save=True),
                        dict(case="state_dict", kind="state_dict", ep=2)])
    first.of("save")  # the resumes need the checkpoint: a failed save shows its own traceback
    second = _launch(2, [dict(case="resume", kind="resume", ep=2, path=ckpt),
                         dict(case="resume-async", kind="resume", ep=2, path=async_ckpt),
                         dict(case="resume-stage1", kind="resume", ep=2, path=ckpt, stage=1),
                         dict(case="weights-without-ep", kind="weights_without_ep", path=ckpt)]
                     + [dict(case=f"refused-{w}", kind="refused", what=w, ep=2, path=ckpt) for w in REFUSED])
    four = _launch(4, [dict(case="resume-4-ep2", kind="resume", ep=2, path=ckpt),
                       dict(case="resume-4-ep4", kind="resume", ep=4, path=ckpt)])
    return first, second, four


def _max_diff(a: dict, b: dict) -> float:
    import torch

    assert sorted(a) == sorted(b)
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


def test_the_checkpoint_holds_each_experts_file(runs):
    first, _, _ = runs
    for rep in first.of("save"):
        assert "experts00000-of-00002.safetensors" in rep["files"]
        assert "experts00001-of-00002.safetensors" in rep["files"]
        assert "metadata.json" in rep["files"]


@pytest.mark.parametrize("case", ["resume", "resume-async"])
def test_resume_equals_the_uninterrupted_run_bit_for_bit(runs, case):
    first, second, _ = runs
    ref = first.of("reference")[0]
    saved = first.of("save" if case == "resume" else "save-async")[0]
    assert saved["losses"] == ref["losses"][:2]
    for rep in second.of(case):
        assert rep["extra"] == {"step": 2}
        assert rep["losses"] == ref["losses"][2:], (rep["losses"], ref["losses"])
        assert rep["weights"] == ref["weights"], _max_diff(rep["weights"], ref["weights"])


def test_resume_equals_one_process(runs):
    first, second, _ = runs
    ref = first.of("reference")[0]
    for mine, one in zip(ref["losses"], ref["one_process_losses"]):
        assert mine == pytest.approx(one, abs=TOL)
    rep = second.of("resume")[0]
    for mine, one in zip(rep["losses"], ref["one_process_losses"][2:]):
        assert mine == pytest.approx(one, abs=TOL)
    assert _max_diff(rep["weights"], ref["one_process_weights"]) < TOL


@pytest.mark.parametrize("case", ["resume-4-ep2", "resume-4-ep4", "resume-stage1"])
def test_resume_at_another_world_and_expert_parallel_size(runs, case):
    """Saved on 2 ranks with expert_parallel_size=2 at stage 3, resumed on 4 with 2 (replicas) or 4, or on 2
    at stage 1: equal to one process within fp32 tolerance (the batch is split otherwise, or the other
    weights reduced otherwise, so not bit for bit)."""
    first, second, four = runs
    ref = first.of("reference")[0]
    for rep in (second if case == "resume-stage1" else four).of(case):
        for mine, one in zip(rep["losses"], ref["one_process_losses"][2:]):
            assert mine == pytest.approx(one, abs=TOL)
        assert _max_diff(rep["weights"], ref["one_process_weights"]) < TOL


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_refused_by_name_and_nothing_changed(runs, what):
    _, second, _ = runs
    for rep in second.of(f"refused-{what}"):
        assert rep["message"] is not None, f"{what} was not refused"
        assert REFUSED[what] in rep["message"], rep["message"]
        assert rep["untouched"]


def test_weights_load_into_a_model_without_expert_parallelism(runs):
    """Without expert parallelism the experts are ordinary stage-3 shards (the [E, ...] tensor split across
    the ranks, through an expert's rows): each rank takes its elements from the per-expert tensors, and
    the full weights equal the saving run's at the save, bit for bit."""
    first, second, _ = runs
    saved = first.of("save")[0]["weights"]
    for rep in second.of("weights-without-ep"):
        assert rep["weights"] == saved, _max_diff(rep["weights"], saved)


def test_optimizer_state_dict_holds_the_experts(runs):
    first, _, _ = runs
    ref = first.of("reference")[0]
    for rep in first.of("state_dict"):
        assert rep["has_experts"]
        assert rep["losses"] == ref["losses"][2:]
        assert rep["weights"] == ref["weights"]
        assert "expert_parallel_size=None" in rep["wrong_size_message"]


def test_accelerate_save_state_and_load_state(tmp_path):
    """The front end's own resume: ``ZeroAccelerator.save_state``/``load_state`` under ``accelerate launch``
    on 2 processes with ``expert_parallel_size=2`` goes through save_checkpoint/load_checkpoint, experts
    included: the resumed run equals the uninterrupted one bit for bit."""
    pytest.importorskip("accelerate")
    from _accelerate_launch import accelerate_launch

    reports, _ = accelerate_launch("accelerate_expert_parallel.py", {}, timeout=240, out=tmp_path)
    for rep in reports:
        assert rep["resumed"] == rep["reference"]
        assert rep["weights_equal"]


@pytest.mark.parametrize("edit", ["num_experts", "shape", "state_key"])
def test_a_forged_experts_entry_is_refused(runs, base, tmp_path, edit):
    """The metadata's ``experts`` entry edited and its checksum recomputed (a forger, not damage): the
    self-consistency checks or the experts file's header refuse it before a tensor byte is read."""
    import json
    import shutil

    from zero_strategy.checkpoint._layout import CheckpointError
    from zero_strategy.checkpoint._metadata_io import read_metadata
    from zero_strategy.checkpoint._validate import check_experts_file, digest

    runs[0].of("save")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base / "ckpt", ckpt)
    d = json.loads((ckpt / "metadata.json").read_text())
    fqn = next(iter(d["experts"]["params"]))
    if edit == "num_experts":
        d["experts"]["params"][fqn]["num_experts"] = 3
    elif edit == "shape":
        d["experts"]["params"][fqn]["shape"][0] += 1
    else:
        d["experts"]["state"][fqn]["tensors"]["../x"] = "float32"
    d["checksum"] = digest(d)
    (ckpt / "metadata.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as err:
        meta = read_metadata(ckpt)
        check_experts_file(ckpt / "experts00000-of-00002.safetensors", meta)
    want = {"num_experts": "is not a multiple of experts.size", "shape": "but metadata.json says",
            "state_key": "is not a state key"}[edit]
    assert want in str(err.value), err.value
