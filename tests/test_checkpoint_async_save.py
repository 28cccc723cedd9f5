"""Asynchronous saves keep every promise of the synchronous save, on 2 ranks.

``save_checkpoint(..., async_save=True)`` returns once the shards are copied into host buffers and
a thread writes them (See [Note: asynchronous saves] in checkpoint/_save.py). Compared with the
synchronous save of the same run: training after it is bit for bit the same, the files are byte
for byte the same (metadata included), though the writer was held until training had changed
every tensor. The staged copies are counted in ``memory_report`` and bounded by the config; the
next save and teardown wait for the writer; a writer's failure is raised by the next save on
every rank, with nothing published; a process killed while its writer writes leaves the previous
checkpoint intact and loadable.
"""

from __future__ import annotations

import filecmp
import functools
import sys
import textwrap
import threading

import pytest
import torch

import zero_strategy as zs
from zero_strategy.checkpoint import _save
from zero_strategy.checkpoint._owned import SAVE_PREFIX
import _procs
from _launch import launch, launch_faulty
from _models import SEQ, VOCAB, TinyLM, param_groups

HOLD = 2.5  # tests/workers/async_save.py holds the writer this long in the waiting cases
CASES = ["parity", "bounded", "next_save_waits", "teardown_waits", "write_error"]


@functools.lru_cache(maxsize=1)
def _results(root: str) -> dict:
    reports = launch("async_save.py", 2, {"dir": root, "cases": CASES}, timeout=300)
    by_case: dict[str, list[dict]] = {}
    for rep in reports:
        for res in rep["results"]:
            by_case.setdefault(res["case"], []).append(res)
    return by_case


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return _results(str(tmp_path_factory.mktemp("async_save")))


def _case(results: dict, name: str) -> list[dict]:
    got = results.get(name, [])
    for rank, res in enumerate(got):
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
    assert len(got) == 2, f"case {name} did not finish on both ranks: an earlier case failed"
    return got


@pytest.mark.multiprocess
def test_training_and_files_after_an_async_save_equal_the_synchronous_saves(results):
    for r in _case(results, "parity"):
        assert r["returned_before_written"], "save_checkpoint waited for the disk"
        assert r["losses_equal"] and r["weights_equal"]
        assert r["same_files"], "the asynchronous save wrote other bytes than the synchronous one"


@pytest.mark.multiprocess
def test_the_staged_copies_are_counted_in_the_memory_report_until_released(results):
    """Staged, then kept for the next save (See [Note: staging buffers kept]), until released."""
    for r in _case(results, "parity"):
        # the rank file's tensors (the file adds only its header)
        assert r["staged_held"] - r["staged_before"] >= r["rank_file_bytes"] - 4096, r
        assert r["staged_kept"] == r["staged_held"] and r["staged_after"] == r["staged_before"], r


@pytest.mark.multiprocess
def test_staging_is_bounded_by_the_config_and_writes_the_same_files(results):
    for r in _case(results, "bounded"):
        assert 0 < r["peak_staged"] <= 4096, r
        assert r["same_files"]


@pytest.mark.multiprocess
def test_the_next_save_waits_for_the_previous_one(results):
    for r in _case(results, "next_save_waits"):
        assert r["returned_at"] < HOLD, "the save did not return while its writer was held"
        assert r["first_complete"] and r["second_complete"]
        assert r["waited"] >= HOLD


@pytest.mark.multiprocess
def test_teardown_waits_for_the_save(results):
    for r in _case(results, "teardown_waits"):
        assert r["returned_at"] < HOLD and r["waited"] >= HOLD and r["complete"], r


@pytest.mark.multiprocess
def test_a_failed_background_write_is_raised_by_the_next_save_on_every_rank(results):
    for rank, r in enumerate(_case(results, "write_error")):
        assert r["message"] is not None, f"rank {rank}: the failure was silent"
        assert "asynchronous save of" in r["message"] and "No space left on device" in r["message"], r["message"]
        assert "rank 1" in r["message"], r["message"]
        assert not r["next_written"], "the save that reported the failure went on writing"
        assert r["leftovers"] == [], "the failed save left its temporary directory"
        assert r["extra"] == {"step": 1} and r["intact"], "the previous checkpoint changed"
        assert r["retry"]


def _tiny():
    torch.manual_seed(1234)
    model = TinyLM(layers=2)
    return zs.setup(model, torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95)),
                    zs.ZeroConfig(stage=3, param_persistence_threshold=0))


@pytest.mark.multiprocess
def test_a_process_killed_while_its_writer_writes_leaves_the_previous_checkpoint(tmp_path):
    (tmp_path / "run").mkdir()
    result = launch_faulty("async_save.py", 2, {"dir": str(tmp_path), "cases": ["kill"]}, survivors=[0, 1],
                           out=tmp_path / "run", timeout=200)
    for rank in (0, 1):
        assert result["codes"][rank] == -9, result["logs"][rank]
        assert result["reports"][rank]["results"][-1] == {"case": "kill", "writing": True}
    (leftover,) = list(tmp_path.glob(f"{SAVE_PREFIX}*"))
    assert not (leftover / "metadata.json").exists(), "a half-written checkpoint got its metadata"
    model, opt = _tiny()
    assert zs.load_checkpoint(tmp_path / "killed", model, opt) == {"step": 1}
    want = torch.load(tmp_path / "killed-step1.pt")
    got = zs.full_state_dict(model, dtype=None)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


# ------------------------------------------------------------------ one process: offload policies, exit
def _train_one(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(500 + step)
        tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g)
        model(tokens).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("preset", ["zero1", "zero2_offload", "zero3_offload_nvme"])
def test_each_offload_policy_saves_the_same_files_and_trains_on_the_same(tmp_path, preset):
    """Host-resident (CPU offload) and NVMe-resident state are staged too: the next step rewrites
    them, and the writer, held until after that step, still writes the state of the save."""
    def run(async_save: bool):
        torch.manual_seed(3)
        model = TinyLM(layers=2)
        cfg = zs.ZeroConfig.preset(preset, param_persistence_threshold=0, **(
            {"offload_optimizer": zs.NVMeOffload(str(tmp_path / "swap")), "offload_params": zs.NVMeOffload(
                str(tmp_path / "swap"))} if "nvme" in preset else {}))
        model, opt = zs.setup(model, torch.optim.AdamW(param_groups(model)), cfg)
        _train_one(model, opt, range(2))
        release = threading.Event()
        _save._before_background_write = lambda item: release.wait()
        target = tmp_path / ("async" if async_save else "sync")
        if not async_save:
            release.set()
        zs.save_checkpoint(target, model, opt, async_save=async_save)
        _train_one(model, opt, range(2, 3))
        release.set()
        zs.checkpoint.wait_for_save(model)
        _save._before_background_write = None
        final = {k: v.clone() for k, v in zs.full_state_dict(model, dtype=None).items()}
        zs.teardown(model)
        return final

    sync, asynchronous = run(False), run(True)
    assert all(torch.equal(sync[k], asynchronous[k]) for k in sync)
    names = sorted(p.name for p in (tmp_path / "sync").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "async").iterdir())
    assert all(filecmp.cmp(tmp_path / "sync" / n, tmp_path / "async" / n, shallow=False) for n in names)


EXIT = textwrap.dedent("""
    import sys, time, torch
    import zero_strategy as zs
    from zero_strategy.checkpoint import _save
    from _models import TinyLM, param_groups
    model = TinyLM(layers=2)
    model, opt = zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(stage=2, async_save=True))
    def hook(item):
        time.sleep(0.3)
        if sys.argv[2] == "fail":
            raise OSError(28, "No space left on device")
    _save._before_background_write = hook
    zs.save_checkpoint(sys.argv[1], model, opt)
    print("returned", flush=True)
""")


@pytest.mark.multiprocess
@pytest.mark.slow  # two cold interpreters
def test_the_interpreters_exit_waits_for_the_save_and_reports_its_failure(tmp_path):
    """A script that ends right after an asynchronous save: its checkpoint is complete, and a failed
    write nobody waited for is printed, not lost."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT)
    ok = _procs.run([sys.executable, str(script), str(tmp_path / "ok"), "ok"], 120, env=_procs.child_env(),
                    merge_stderr=True)
    assert ok.returncode == 0 and "returned" in ok.stdout, ok.stdout
    assert (tmp_path / "ok" / "metadata.json").is_file(), "the exit cut the save off"
    bad = _procs.run([sys.executable, str(script), str(tmp_path / "bad"), "fail"], 120, env=_procs.child_env(),
                     merge_stderr=True)
    assert "asynchronous checkpoint save" in bad.stdout and "FAILED" in bad.stdout, bad.stdout
    assert "No space left on device" in bad.stdout and not (tmp_path / "bad").exists()
