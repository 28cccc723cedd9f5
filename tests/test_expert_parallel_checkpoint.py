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

The offline tools, in this process on the checkpoint of the first launch: ``consolidate`` writes the
saving run's full state dict bit for bit (the fused experts rebuilt from the per-expert tensors), and
transformers' ``from_pretrained`` of it (with the run's config) gives the expert-parallel model's logits
bit for bit; ``export_checkpoint`` to DCP (read back by torch's ``dcp_to_torch_save``) and to
DeepSpeed's universal layout holds the same weights and the experts' moments; a tampered experts file
is refused before anything is written.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _launch import launch_cases  # noqa: E402

pytestmark = pytest.mark.multiprocess

TOL = 1e-5
REFUSED = {
    "tamper": "is corrupted: its xxh3_128 digest",
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
def first(base):
    """Launch 1 saves (sync and async): what the offline tools (consolidate) need."""
    ckpt, async_ckpt = str(base / "ckpt"), str(base / "ckpt-async")
    return _launch(2, [dict(case="reference", kind="reference", ep=2),
                       dict(case="save", kind="save", ep=2, path=ckpt),
                       dict(case="save-async", kind="save", ep=2, path=async_ckpt, async_save=True),
                       dict(case="state_dict", kind="state_dict", ep=2)])


@pytest.fixture(scope="module")
def runs(base, first):
    """Launch 1 saves (sync and async); launch 2 resumes on 2 ranks; launch 3 on 4 ranks."""
    ckpt, async_ckpt = str(base / "ckpt"), str(base / "ckpt-async")
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


# ------------------------------------------------------------------ the offline tools
def test_consolidate_equals_the_runs_state_dict(first, base, tmp_path):
    """``consolidate`` rebuilds each fused ``[E, ...]`` experts tensor from the per-expert tensors, under the
    names a run without expert parallelism writes: the output equals the saving run's full state dict at
    the save (``zero_strategy.full_state_dict``), bit for bit, in safetensors and torch formats; the
    optimizer's file holds the experts' moments fused the same way, of the parameter's shape."""
    import torch
    from safetensors.torch import load_file

    import zero_strategy as zs

    saved = first.of("save")[0]["weights"]
    out = zs.checkpoint.consolidate(base / "ckpt", tmp_path / "st", include_optimizer=True)
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(saved)
    for k, v in saved.items():
        assert torch.equal(got[k], torch.tensor(v, dtype=got[k].dtype)), k
    optim = load_file(out / "optimizer.safetensors")
    experts = [k for k in saved if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts
    for k in experts:
        for key in ("exp_avg", "exp_avg_sq"):
            assert optim[f"{k}.{key}"].shape == got[k].shape and optim[f"{k}.{key}"].abs().sum() > 0
        assert optim[f"{k}.step"].item() == 2
    torch_out = zs.checkpoint.consolidate(base / "ckpt", tmp_path / "pt", format="torch")
    full = torch.load(torch_out / "pytorch_model.bin")
    assert all(torch.equal(full[k], got[k]) for k in got)


def test_export_reads_back_in_transformers_with_the_runs_logits(first, base, tmp_path):
    """The user's way out of an expert-parallel checkpoint without launching the run again: consolidate with
    the model's config, then transformers' own ``from_pretrained``; its logits equal the expert-parallel
    model's at the save."""
    import torch
    import transformers

    import zero_strategy as zs

    rep = first.of("save")[0]
    out = zs.checkpoint.consolidate(base / "ckpt", tmp_path / "hf", hf_config=str(base / "ckpt") + "-config")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(rep["tokens"])).logits
    assert torch.equal(logits, torch.tensor(rep["logits"])), (logits - torch.tensor(rep["logits"])).abs().max()


def test_consolidate_of_a_tampered_experts_file_is_refused(first, base, tmp_path):
    """A flipped byte in an experts file: refused by name (its digest) before anything is written."""
    import shutil

    import zero_strategy as zs
    from zero_strategy.checkpoint import CheckpointError

    first.of("save")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(base / "ckpt", ckpt)
    victim = ckpt / "experts00001-of-00002.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupted: its xxh3_128 digest"):
        zs.checkpoint.consolidate(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]


def test_export_dcp_and_deepspeed_universal_hold_the_fused_experts(first, base, tmp_path):
    """``export_checkpoint`` writes the experts as whole fused parameters: DCP (read back by torch's own
    ``dcp_to_torch_save``) and DeepSpeed's universal layout (``zero/<name>/fp32.pt``, ``exp_avg.pt``, ...)
    hold the run's weights at the save bit for bit, and the experts' moments equal consolidate's."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import zero_strategy as zs

    saved = first.of("save")[0]["weights"]
    consolidated = zs.checkpoint.consolidate(base / "ckpt", tmp_path / "st", include_optimizer=True)
    moments = load_file(consolidated / "optimizer.safetensors")
    experts = [k for k in saved if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]

    dcp = zs.checkpoint.export_checkpoint(base / "ckpt", tmp_path / "dcp", format="dcp")
    dcp_to_torch_save(dcp, tmp_path / "dcp.pt")
    whole = torch.load(tmp_path / "dcp.pt", weights_only=False)
    assert sorted(whole["model"]) == sorted(saved)
    for k, v in saved.items():
        assert torch.equal(whole["model"][k], torch.tensor(v, dtype=whole["model"][k].dtype)), k
    state, groups = whole["optim"]["state"], whole["optim"]["param_groups"]
    for k in experts:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[k][key], moments[f"{k}.{key}"]), (k, key)
        assert k in groups[0]["params"]

    ds = zs.checkpoint.export_checkpoint(base / "ckpt", tmp_path / "ds", format="deepspeed-universal")
    zero = ds / (ds / "latest_universal").read_text() / "zero"
    for k in experts:
        assert torch.equal(torch.load(zero / k / "fp32.pt")["param"], torch.tensor(saved[k]))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.load(zero / k / f"{key}.pt")["param"], moments[f"{k}.{key}"])
        assert torch.load(zero / k / "step.pt").item() == 2


@pytest.mark.parametrize("format", ["dcp", "deepspeed-universal"])
def test_the_export_resumes_in_one_process_as_one_process_trains(first, base, tmp_path, format):
    """The export read back by the readers of those formats into one process without expert parallelism,
    optimizer included: 2 more steps on the whole batch give the losses of one process trained 4 steps
    from the start (within fp32 tolerance, as the expert-parallel run itself is): the fused moments are
    the experts' own."""
    import torch
    import transformers

    import zero_strategy as zs

    ref = first.of("reference")[0]
    first.of("save")
    out = zs.checkpoint.export_checkpoint(base / "ckpt", tmp_path / "out", format=format)
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(str(base / "ckpt") + "-config"))
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                          zs.ZeroConfig(stage=1))
    zs.checkpoint.load_checkpoint(out, model, opt)
    losses = []
    for step in (2, 3):  # the batches of tests/workers/expert_parallel.py, whole
        whole = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(31 + step))
        loss = model(input_ids=whole, labels=whole).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == pytest.approx(ref["one_process_losses"][2:], abs=TOL)
