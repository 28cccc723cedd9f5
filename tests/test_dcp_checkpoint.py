"""PyTorch DCP checkpoints in and out: a run moves between FSDP2 and zero_strategy mid-way, at any
world size and stage (tests/workers/dcp_checkpoint.py: TinyLM with tied weights, a frozen parameter
and a 1-element parameter; torch AdamW over two param groups with their own lr and weight decay).

In: an FSDP2 run (``fully_shard``, 2 gloo ranks) trains 3 steps, saves with DCP in the two usual
layouts (``{"model", "optim"}`` of ``get_state_dict`` as the PyTorch tutorials write it, and
torchtitan's: the model at the top level, the optimizer flattened under ``optimizer``) and trains
on to 6. Our zero1/zero2/zero3 on 1 and 2 ranks load each and train the same 3 steps (and zero3
with the optimizer offloaded to the CPU, and with optimizer and parameters on NVMe). On 2 ranks each rank reads only the saved chunks that
overlap its own shard.

Out: our zero2 and zero3 runs on 2 ranks save after 3 steps; ``export_checkpoint(..., format="dcp")``
writes the saved checkpoint as DCP, and ``save_dcp`` the live shards (every rank its own); FSDP2 on 1
and 2 ranks loads each with ``dcp.load`` + ``set_state_dict`` and trains the same 3 steps our run
trained on.

What is compared: right after the load, the weights equal the saving run's at its save, bit for
bit (elements are copied, never recomputed); every continued loss and the final weights equal the
saving run continuing itself, within 1e-5 relative (fp32: both sides run the same AdamW on the
same averaged gradients; only the order of the sums in the gradient reduction differs: measured
0 on 2 ranks, 7e-8 on the losses and 1.2e-7 on the weights on 1 rank). The same resume with the
Adam moments lost would miss by far more (see test_deepspeed_checkpoint_import.py: 1e-3 on losses).

``consolidate`` writes the model of either DCP layout as FSDP2 held it at its save.

Refusals (one process): a DCP directory of another model names what differs (``strict=False`` loads
what both have); optimizer state of another optimizer class, or keyed by index, is refused; a
pickled object outside the allowlist, in the metadata or in a saved value, is refused naming the
file and the type, runs nothing, and changes nothing; a truncated file is refused before anything
changes, alike on two ranks.
"""

from __future__ import annotations

import functools
import pickle
import re
from pathlib import Path

import pytest
import torch

from _compare import worst_rel_diff
from _launch import launch

pytestmark = pytest.mark.multiprocess

TOL = 1e-5
LAYOUTS = ("nested", "torchtitan")
#: our run written as DCP: its saved checkpoint exported (export_checkpoint), or its live shards (save_dcp)
HOWS = ("dcp", "live")


def _by_name(reports: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = {}
    for rep in reports:
        for res in rep["results"]:
            by.setdefault(res["name"], []).append(res)
    return by


def _ok(by: dict, name: str, world: int) -> list[dict]:
    got = by.get(name, [])
    for res in got:
        assert "error" not in res, res["error"]
    assert len(got) == world, f"{name} finished on {len(got)} of {world} ranks: {by}"
    return got


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """The FSDP2 run: its DCP checkpoints (one per layout) and ``reference.pt``."""
    root = tmp_path_factory.mktemp("fsdp_run")
    dirs = {layout: str(root / layout) for layout in LAYOUTS}
    by = _by_name(launch("dcp_checkpoint.py", 2, {"mode": "fsdp", "cases": [{"name": "fsdp", "dirs": dirs}]},
                         timeout=300))
    _ok(by, "fsdp", 2)
    return root


@functools.lru_cache(maxsize=None)
def _ours(world: int, root: str) -> tuple[dict, Path]:
    """Every layout resumed at zero1/2/3 on ``world`` ranks, in one launch."""
    out = Path(root) / f"ours_w{world}"
    out.mkdir(exist_ok=True)
    cases = [dict(name=f"{layout}-zero{stage}", stage=stage, dir=str(Path(root) / layout))
             for layout in LAYOUTS for stage in (1, 2, 3)]
    cases.append(dict(name="nested-zero3-offload", stage=3, offload="cpu", dir=str(Path(root) / "nested")))
    cases.append(dict(name="nested-zero3-nvme", stage=3, offload="nvme", nvme_path=str(out / "nvme"),
                      dir=str(Path(root) / "nested")))
    return _by_name(launch("dcp_checkpoint.py", world, {"mode": "ours", "cases": cases}, timeout=400, out=out)), out


def _assert_continues(losses: list, ours: dict, ref: dict) -> None:
    for k, want in ref["at_save"].items():
        assert torch.equal(ours["at_load"][k], want), f"{k} after the load differs from the saving run's at its save"
    rel = [abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])]
    assert len(losses) == len(ref["losses"]) and max(rel) < TOL, f"losses {losses} vs the saving run's {ref['losses']}"
    worst, where = worst_rel_diff(ours["final"], ref["final"])
    assert worst < TOL, f"final weights differ from the saving run's by {worst:.2e} ({where})"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", [f"{layout}-zero{stage}" for layout in LAYOUTS for stage in (1, 2, 3)]
                         + ["nested-zero3-offload", "nested-zero3-nvme"])
def test_resumes_an_fsdp2_run_as_fsdp2_continues_it(fsdp_run, name, world):
    by, out = _ours(world, str(fsdp_run))
    results = _ok(by, name, world)
    ref = torch.load(fsdp_run / "reference.pt", weights_only=True)
    _assert_continues(results[0]["losses"], torch.load(out / f"{name}.pt", weights_only=True), ref)
    assert results[0]["extra"] is None
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in results[0]["hyper"]] == \
        [(3e-3, 0.1, [0.9, 0.95]), (6e-3, 0.0, [0.9, 0.95])]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_rank_reads_only_the_chunks_that_overlap_its_shard(fsdp_run, stage):
    """On 2 ranks each rank keeps half of every flat group (masters and Adam state, at every stage), so
    it reads about half of the saved chunks, never the whole model: the FSDP2 run saved two chunks per
    tensor (its two ranks' rows); a rank reads both only where its shard spans the tensor's middle
    (measured: 48% and 55% of the saved elements)."""
    from torch.distributed.checkpoint import FileSystemReader

    by, _ = _ours(2, str(fsdp_run))
    md = FileSystemReader(str(fsdp_run / "nested")).read_metadata()
    saved = sum(c.sizes.numel() for k, e in md.state_dict_metadata.items() if hasattr(e, "chunks")
                for c in e.chunks)
    for rank, res in enumerate(_ok(by, f"nested-zero{stage}", 2)):
        assert 0 < res["read_elements"] < 0.7 * saved, \
            f"rank {rank} read {res['read_elements']} of the {saved} saved elements"


@pytest.fixture(scope="module")
def our_runs(tmp_path_factory) -> Path:
    """Our zero2 and zero3 runs on 2 ranks, each saved after 3 steps and exported to DCP."""
    root = tmp_path_factory.mktemp("our_runs")
    cases = [dict(name=f"zero{s}", stage=s, dir=str(root / f"zero{s}" / "ckpt"), dcp=str(root / f"zero{s}" / "dcp"),
                  live=str(root / f"zero{s}" / "live")) for s in (2, 3)]
    by = _by_name(launch("dcp_checkpoint.py", 2, {"mode": "ours_save", "cases": cases}, timeout=300))
    for case in cases:
        _ok(by, case["name"], 2)
    return root


@functools.lru_cache(maxsize=None)
def _fsdp_resumes(world: int, root: str) -> tuple[dict, Path]:
    out = Path(root) / f"fsdp_w{world}"
    out.mkdir(exist_ok=True)
    cases = [dict(name=f"zero{s}-{how}", dir=str(Path(root) / f"zero{s}" / how)) for s in (2, 3) for how in HOWS]
    return _by_name(launch("dcp_checkpoint.py", world, {"mode": "fsdp_resume", "cases": cases}, timeout=300,
                           out=out)), out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("stage", [2, 3])
def test_fsdp2_resumes_our_run_written_as_dcp_as_we_continue_it(our_runs, stage, how, world):
    by, out = _fsdp_resumes(world, str(our_runs))
    results = _ok(by, f"zero{stage}-{how}", world)
    ref = torch.load(our_runs / f"zero{stage}" / "reference.pt", weights_only=True)
    _assert_continues(results[0]["losses"], torch.load(out / f"zero{stage}-{how}.pt", weights_only=True), ref)
    assert [(g["lr"], g["weight_decay"]) for g in results[0]["hyper"]] == [(3e-3, 0.1), (6e-3, 0.0)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_consolidate_writes_the_model_of_an_fsdp2_dcp_checkpoint(fsdp_run, layout, tmp_path):
    """The Hugging Face export works from DCP too: every entry of the model's state dict, bit for bit
    what FSDP2 held at its save, and nothing of the optimizer or a torchtitan run's other state."""
    from safetensors.torch import load_file

    import zero_strategy as zs

    out = zs.checkpoint.consolidate(fsdp_run / layout, tmp_path / "hf")
    got = load_file(out / "model.safetensors")
    ref = torch.load(fsdp_run / "reference.pt", weights_only=True)["at_save"]
    assert sorted(got) == sorted(ref)
    for k, want in ref.items():
        assert torch.equal(got[k], want), k


# ------------------------------------------------------------------ refusals (one process)
def _setup_tiny(layers: int = 2, dim: int | None = None):
    import zero_strategy as zs
    from _models import TinyLM, param_groups

    torch.manual_seed(0)
    model = TinyLM(layers=layers) if dim is None else TinyLM(layers=layers, dim=dim)
    opt = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95))
    return zs.setup(model, opt, zs.ZeroConfig(stage=2, param_persistence_threshold=0))


def _snapshot(model, zopt) -> dict:
    import zero_strategy as zs
    return {"weights": zs.full_state_dict(model, dtype=None),
            "state": [{k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                      for st in zopt.optimizer.state.values()],
            "lr": [pg["lr"] for pg in zopt.optimizer.param_groups]}


def _same(a: dict, b: dict) -> bool:
    def eq(x, y):
        return torch.equal(x, y) if torch.is_tensor(x) else x == y
    return (a["weights"].keys() == b["weights"].keys() and all(eq(v, b["weights"][k]) for k, v in a["weights"].items())
            and a["lr"] == b["lr"] and len(a["state"]) == len(b["state"])
            and all(x.keys() == y.keys() and all(eq(v, y[k]) for k, v in x.items()) for x, y in zip(a["state"], b["state"])))


def _trained_tiny():
    """A set-up model after one step (it has optimizer state a refused load must keep)."""
    from _models import batch, loss_fn

    model, zopt = _setup_tiny()
    tokens, targets = batch(0, 0, 0)
    zopt.backward(loss_fn(model(tokens), targets))
    zopt.step()
    zopt.zero_grad()
    return model, zopt


def test_a_dcp_run_of_another_model_is_refused_naming_the_difference(fsdp_run):
    import zero_strategy as zs

    model, zopt = _setup_tiny(layers=3)
    with pytest.raises(zs.CheckpointError, match=r"does not match the model: missing from the checkpoint: "
                       r"\['layers\.2\.fc1\.bias'"):
        zs.load_checkpoint(fsdp_run / "nested", model, zopt)

    model, zopt = _setup_tiny(dim=16)
    with pytest.raises(zs.CheckpointError, match=r"parameter shapes differ: \['frozen_mix: checkpoint "
                       r"\(24, 24\), model \(16, 16\)'"):
        zs.load_checkpoint(fsdp_run / "torchtitan", model, zopt)

    other = torch.nn.Linear(4, 4)
    model, zopt = zs.setup(other, torch.optim.AdamW(other.parameters()), "zero2")
    with pytest.raises(zs.CheckpointError, match=r"none of its tensors is one of the model's parameters or buffers "
                       r"\(its first entries: \['embed\.weight'"):
        zs.load_checkpoint(fsdp_run / "torchtitan", model, zopt)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in this one process
def test_a_dcp_run_saved_with_sgd_is_not_resumed_with_adamw(tmp_path):
    """DCP records no optimizer class: the saved param groups' fields say it (SGD's momentum is not Adam's)."""
    import torch.distributed.checkpoint as dcp
    import zero_strategy as zs
    from _models import TinyLM

    torch.manual_seed(0)
    ref = TinyLM(layers=2)
    sgd = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    sd = {"model": ref.state_dict(), "optim": {
        "state": {n: {"momentum_buffer": torch.zeros_like(p)} for n, p in ref.named_parameters() if p.requires_grad},
        "param_groups": [{**{k: v for k, v in sgd.param_groups[0].items() if k != "params"},
                          "params": [n for n, p in ref.named_parameters() if p.requires_grad]}]}}
    dcp.save(sd, checkpoint_id=str(tmp_path / "sgd"), no_dist=True)
    model, zopt = _trained_tiny()
    before = _snapshot(model, zopt)
    with pytest.raises(zs.CheckpointError, match=r"param group 0 was saved with fields \['dampening', 'momentum', "
                       r"'nesterov'\] that the running AdamW does not have"):
        zs.load_checkpoint(tmp_path / "sgd", model, zopt)
    assert _same(before, _snapshot(model, zopt))


class AppState:
    """The PyTorch DCP recipe's ``Stateful`` wrapper: ``dcp.save({"app": AppState(model, optimizer)})``."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):  # pragma: no cover - DCP's protocol; only saved here
        raise NotImplementedError


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in this one process
def test_the_recipes_app_state_layout_resumes_with_its_adam_state(tmp_path):
    """``{"app": AppState}`` puts everything one prefix deeper; the moments and step arrive as saved."""
    import torch.distributed.checkpoint as dcp
    import zero_strategy as zs
    from _models import TinyLM, batch, loss_fn, param_groups

    torch.manual_seed(5)
    ref = TinyLM(layers=2)
    adamw = torch.optim.AdamW(param_groups(ref), betas=(0.9, 0.95))
    for step in range(2):
        tokens, targets = batch(0, step, 0)
        loss_fn(ref(tokens), targets).backward()
        adamw.step()
        adamw.zero_grad()
    dcp.save({"app": AppState(ref, adamw)}, checkpoint_id=str(tmp_path / "app"), no_dist=True)

    model, zopt = _setup_tiny()
    zs.load_checkpoint(tmp_path / "app", model, zopt)
    weights = zs.full_state_dict(model, dtype=None)
    for name, p in ref.named_parameters():
        assert torch.equal(weights[name], p.detach()), name
    assert {float(st["step"]) for st in zopt.optimizer.state.values()} == {2.0}
    # the moments arrived where they belong: one more step on each side lands on the same weights
    tokens, targets = batch(0, 2, 0)
    loss_fn(ref(tokens), targets).backward()
    adamw.step()
    zopt.backward(loss_fn(model(tokens), targets))
    zopt.step()
    worst, where = worst_rel_diff(zs.full_state_dict(model, dtype=None), dict(ref.named_parameters()))
    assert worst < TOL, f"{where} differs by {worst:.2e} after a step from the loaded state"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in this one process
def test_optimizer_state_keyed_by_index_is_refused(tmp_path):
    """A raw ``optimizer.state_dict()`` numbers the parameters: nothing says which is which."""
    import torch.distributed.checkpoint as dcp
    import zero_strategy as zs
    from _models import TinyLM, batch, loss_fn

    torch.manual_seed(0)
    ref = TinyLM(layers=2)
    adamw = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad])
    tokens, targets = batch(0, 0, 0)
    loss_fn(ref(tokens), targets).backward()
    adamw.step()
    dcp.save({"model": ref.state_dict(), "optim": adamw.state_dict()}, checkpoint_id=str(tmp_path / "raw"),
             no_dist=True)
    model, zopt = _trained_tiny()
    with pytest.raises(zs.CheckpointError, match=r"optimizer state keyed by parameter index \(optim\.state\.0\..*"
                       r"get_optimizer_state_dict"):
        zs.load_checkpoint(tmp_path / "raw", model, zopt)
    zs.load_checkpoint(tmp_path / "raw", model)  # the weights alone load
    assert torch.equal(zs.full_state_dict(model, dtype=None)["layers.1.fc2.weight"], ref.layers[1].fc2.weight)


def test_strict_false_loads_what_model_and_checkpoint_share(fsdp_run):
    import zero_strategy as zs

    model, zopt = _setup_tiny(layers=3)
    before = zs.full_state_dict(model, dtype=None)["layers.2.fc1.weight"].clone()
    with pytest.warns(UserWarning, match=r"missing from the checkpoint: \['layers\.2\.fc1\.bias'"):
        zs.load_checkpoint(fsdp_run / "nested", model, zopt, strict=False)
    after = zs.full_state_dict(model, dtype=None)
    ref = torch.load(fsdp_run / "reference.pt", weights_only=True)["at_save"]
    assert torch.equal(after["layers.1.fc2.weight"], ref["layers.1.fc2.weight"])
    assert torch.equal(after["layers.2.fc1.weight"], before)  # not in the checkpoint: kept


class Hostile:
    """What an attacker would pickle: unpickling it would call os.system (here: create ``marker``)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os
        return (os.system, (f"touch '{self.marker}'",))


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_a_pickled_object_outside_the_allowlist_is_refused(fsdp_run, tmp_path):
    import zero_strategy as zs
    from torch.distributed.checkpoint import FileSystemReader

    # in the metadata: DCP itself would unpickle it with pickle.load
    bad = _copy(fsdp_run / "nested", tmp_path / "bad_metadata")
    md = FileSystemReader(str(bad)).read_metadata()
    md.planner_data = {"hook": Hostile(tmp_path / "ran")}
    (bad / ".metadata").write_bytes(pickle.dumps(md))
    model, zopt = _trained_tiny()
    before = _snapshot(model, zopt)
    with pytest.raises(zs.CheckpointError, match=r"\.metadata holds a pickled object of type posix\.system .*refused"):
        zs.load_checkpoint(bad, model, zopt)
    assert not (tmp_path / "ran").exists()
    assert _same(before, _snapshot(model, zopt))

    # in a saved value (a hyperparameter): DCP's default planner would torch.load it with weights_only=False
    bad = _copy(fsdp_run / "nested", tmp_path / "bad_value")
    md = FileSystemReader(str(bad)).read_metadata()
    index = next(i for i in md.storage_data if i.fqn == "optim.param_groups.0.lr")
    info = md.storage_data[index]
    import io
    buf = io.BytesIO()
    torch.save(Hostile(tmp_path / "ran"), buf)
    with open(bad / info.relative_path, "ab") as f:
        offset = f.tell()
        f.write(buf.getvalue())
    md.storage_data[index] = type(info)(info.relative_path, offset, len(buf.getvalue()))
    (bad / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(zs.CheckpointError, match=r"holds a pickled object of type posix\.system .*refused"):
        zs.load_checkpoint(bad, model, zopt)
    assert not (tmp_path / "ran").exists()
    assert _same(before, _snapshot(model, zopt))


def test_a_truncated_chunk_file_is_refused_before_anything_changes(fsdp_run, tmp_path):
    import zero_strategy as zs

    bad = _copy(fsdp_run / "nested", tmp_path / "truncated")
    f = bad / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    model, zopt = _trained_tiny()
    before = _snapshot(model, zopt)
    with pytest.raises(zs.CheckpointError, match=r"__1_0\.distcp is truncated"):
        zs.load_checkpoint(bad, model, zopt)
    assert _same(before, _snapshot(model, zopt))


def test_two_ranks_refuse_a_damaged_dcp_checkpoint_alike_and_change_nothing(fsdp_run, tmp_path):
    """A file only some ranks read is damaged: the ranks agree, every rank raises the same error, none
    has copied anything (See [Note: verify, agree, then copy] in _load.py)."""
    bad = _copy(fsdp_run / "nested", tmp_path / "truncated")
    f = bad / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    cases = [dict(name=f"truncated-zero{stage}", stage=stage, dir=str(bad)) for stage in (2, 3)]
    by = _by_name(launch("dcp_checkpoint.py", 2, {"mode": "refused", "cases": cases}, timeout=240))
    for case in cases:
        got = _ok(by, case["name"], 2)
        assert got[0]["error_message"] == got[1]["error_message"], got
        assert re.search(r"__1_0\.distcp is truncated", got[0]["error_message"] or ""), got[0]["error_message"]
        assert got[0]["changed"] == [] and got[1]["changed"] == [], got
