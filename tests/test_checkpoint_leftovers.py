"""Saves and consolidation remove only directories they created (see [Note: what a save may
delete] in checkpoint/_owned.py), and leave nothing behind when they fail or are killed.

Before, a save deleted every ``<name>.old-*`` and ``<name>.tmp-*`` beside its target by
an unescaped glob: a user's ``ckpt.old-manual-backup/`` went with its contents, and a
save to ``run[1]`` deleted another job's in-progress ``run1.tmp-.../``.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import zero_strategy as zs
from zero_strategy.checkpoint._owned import MARKER
from _models import TinyLM, param_groups
import _procs
from _launch import run_code

TOKEN = "0123456789ab"


def _tiny():
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    return zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(stage=2))


def _user_dir(path: Path, marker: str | None = None) -> Path:
    path.mkdir()
    (path / "notes.txt").write_text("keep me")
    if marker is not None:
        (path / MARKER).write_text(marker)
    return path


def _save_twice(path):
    model, opt = _tiny()
    zs.save_checkpoint(path, model, opt)
    zs.save_checkpoint(path, model, opt)  # the second replaces the first: the old/tmp clean-up runs


def test_users_backup_directories_survive(tmp_path):
    kept = [_user_dir(tmp_path / "ckpt.old-manual-backup"), _user_dir(tmp_path / "ckpt.tmp-notes"),
            _user_dir(tmp_path / f"ckpt.tmp-{TOKEN}"),  # our pattern, but no marker: not made by a save
            _user_dir(tmp_path / f"ckpt.old-{TOKEN}", marker="ffffffffffff")]  # marker of another token
    _save_twice(tmp_path / "ckpt")
    for d in kept:
        assert (d / "notes.txt").read_text() == "keep me", d


def test_a_name_with_glob_characters_matches_only_itself(tmp_path):
    other = _user_dir(tmp_path / f"run1.tmp-{TOKEN}", marker=TOKEN)  # looks like a leftover of "run1"
    _save_twice(tmp_path / "run[1]")
    assert (other / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["run[1]", other.name])


def test_planted_symlink_with_a_leftover_name_is_not_followed(tmp_path):
    victim = _user_dir(tmp_path / "victim", marker=TOKEN)
    (tmp_path / f"ckpt.tmp-{TOKEN}").symlink_to(victim)
    _save_twice(tmp_path / "ckpt")
    assert (victim / "notes.txt").read_text() == "keep me"
    assert (tmp_path / f"ckpt.tmp-{TOKEN}").is_symlink()


def test_a_directory_moved_under_the_temporary_name_is_not_removed(tmp_path, monkeypatch):
    """Issue 38: in a folder others can write to (no sticky bit), someone renames the save's temporary
    directory away and moves another of your directories under its name; the failed save's clean-up
    went by the name and deleted that directory."""
    from zero_strategy.checkpoint import _save

    precious = _user_dir(tmp_path / "precious")

    def write_metadata(tmp, meta):
        tmp.rename(tmp_path / "moved")
        precious.rename(tmp)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_save, "_write_metadata", write_metadata)
    model, opt = _tiny()
    with pytest.raises(zs.CheckpointError, match="No space left on device"):
        zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    (moved_precious,) = [p for p in tmp_path.iterdir() if (p / "notes.txt").exists()]
    assert (moved_precious / "notes.txt").read_text() == "keep me"
    assert list((tmp_path / "moved").iterdir()) == []  # the save's own files went, through its descriptor


def test_on_nfs_the_leftover_of_a_killed_save_is_still_removed(tmp_path, monkeypatch):
    """NFS refuses an exclusive flock through a read-only descriptor (EBADF): the marker was
    opened read-only, so no leftover on NFS was ever removed."""
    import fcntl

    real = fcntl.flock

    def nfs_flock(fd, op):
        if op & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", nfs_flock)
    dead = _user_dir(tmp_path / f"ckpt.tmp-{TOKEN}", marker=TOKEN)
    _save_twice(tmp_path / "ckpt")
    assert not dead.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_lightning_pruning_keeps_backups_and_other_jobs_directories(tmp_path):
    """ModelCheckpoint's pruning (``strategy.remove_checkpoint``) deleted ``<name>.tmp-*`` and
    ``<name>.old-*`` by an unescaped glob: a user's backup went, and ``run[1]`` took ``run1``'s."""
    pytest.importorskip("lightning")
    from zero_strategy.lightning import ZeroStrategy

    model, opt = _tiny()
    for name in ("x.ckpt", "run[1].ckpt"):
        zs.save_checkpoint(tmp_path / name, model, opt)
    kept = [_user_dir(tmp_path / "x.ckpt.old-manual-backup"),
            _user_dir(tmp_path / f"run1.ckpt.tmp-{TOKEN}", marker=TOKEN)]  # another job's, alive or not
    victim = _user_dir(tmp_path / "victim")
    (tmp_path / "link.ckpt").symlink_to(victim)
    strategy = ZeroStrategy(stage=2)
    for name in ("x.ckpt", "run[1].ckpt", "link.ckpt"):
        strategy.remove_checkpoint(tmp_path / name)
    for d in kept + [victim]:
        assert (d / "notes.txt").read_text() == "keep me", d
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(d.name for d in kept + [victim])


def test_lightnings_hpc_scan_reads_no_number_from_a_save_in_progress_or_killed(tmp_path, monkeypatch):
    """SLURM auto-requeue names and finds ``hpc_ckpt_<n>.ckpt`` by the digits of every name holding
    ``ckpt_``: ``hpc_ckpt_2.ckpt.tmp-0a1b...`` read as 201..., on the ranks scanning during the save
    and on every requeued job after a kill. (The real SIGUSR1 run: test_lightning_requeue.py.)"""
    pytest.importorskip("lightning")
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from zero_strategy.checkpoint import _save

    model, opt = _tiny()
    zs.save_checkpoint(tmp_path / "hpc_ckpt_1.ckpt", model, opt)
    seen = []

    def killed(tmp, meta):
        seen.append(_CheckpointConnector.hpc_save_path(tmp_path))  # what another rank would name it now
        raise KeyboardInterrupt

    monkeypatch.setattr(_save, "_write_metadata", killed)
    monkeypatch.setattr(_save.OwnedDir, "remove", lambda self: self.release())  # as if killed: left behind
    with pytest.raises(KeyboardInterrupt):
        zs.save_checkpoint(tmp_path / "hpc_ckpt_2.ckpt", model, opt)
    assert seen == [str(tmp_path / "hpc_ckpt_2.ckpt")]
    assert len(list(tmp_path.iterdir())) == 2  # the checkpoint and the leftover
    assert _CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")


HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(120)
""")


@pytest.mark.multiprocess
def test_leftover_of_a_killed_save_is_removed_unless_its_save_is_alive(tmp_path):
    """Both carry a marker with their token; only the one whose lock is free is a leftover."""
    live = _user_dir(tmp_path / f"ckpt.tmp-{TOKEN}", marker=TOKEN)
    dead = _user_dir(tmp_path / "ckpt.tmp-ba9876543210", marker="ba9876543210")
    holder = _procs.start([sys.executable, "-c", HOLD, str(live / MARKER)], stderr=None)
    try:
        assert holder.stdout.readline().strip() == "locked"
        _save_twice(tmp_path / "ckpt")
        assert (live / "notes.txt").exists(), "the directory of a save that is still running was removed"
        assert not dead.exists(), "the leftover of a killed save was kept"
    finally:
        holder.kill()
        holder.wait()


KILLED_CONSOLIDATE = textwrap.dedent("""
    import os, signal, sys
    from zero_strategy.checkpoint import _safetensors_stream
    from zero_strategy.cli import main
    original = _safetensors_stream.StreamWriter.write
    def write(self, name, piece):
        original(self, name, piece)
        os.kill(os.getpid(), getattr(signal, sys.argv[3]))
    _safetensors_stream.StreamWriter.write = write
    sys.exit(main(["consolidate", sys.argv[1], sys.argv[2]]))
""")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "ckpt"
    model, opt = _tiny()
    zs.save_checkpoint(path, model, opt)
    return path


def _consolidate_killed(ckpt, tmp_path, sig) -> tuple[int, str, Path]:
    """``zero-strategy consolidate CKPT DEST/out`` in a process of its own, which signals itself ``sig``
    after its first write: its exit code, its log, and DEST, which held nothing else. The process is
    warm (tests/_launch.py's ``run_code``): its start is not the subject, and its files stay out of DEST."""
    dest = tmp_path / "dest"
    dest.mkdir()
    code, _, log = run_code(KILLED_CONSOLIDATE, tmp_path, _procs.child_env(), 60, [str(ckpt), str(dest / "out"), sig])
    return code, log, dest


@pytest.mark.multiprocess
@pytest.mark.slow
def test_consolidate_terminated_removes_its_temporary_directory(ckpt, tmp_path):
    code, log, dest = _consolidate_killed(ckpt, tmp_path, "SIGTERM")
    assert code == 128 + signal.SIGTERM, log
    assert list(dest.iterdir()) == []


@pytest.mark.multiprocess
def test_consolidate_killed_leaves_a_leftover_the_next_run_removes(ckpt, tmp_path):
    code, log, dest = _consolidate_killed(ckpt, tmp_path, "SIGKILL")
    assert code == -signal.SIGKILL, log
    (leftover,) = dest.iterdir()
    assert leftover.name.startswith(".out.tmp-")
    zs.checkpoint.consolidate(ckpt, dest / "out")
    assert sorted(p.name for p in dest.iterdir()) == ["out"]
    assert sorted(p.name for p in (dest / "out").iterdir()) == ["model.safetensors"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_consolidate_cli_reports_a_damaged_checkpoint_in_one_line(ckpt, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    (damaged / "metadata.json").write_text('{"format": "zero_strategy.checkpoint", "version": 1, "x": [')
    done = _procs.run([sys.executable, "-m", "zero_strategy.cli", "consolidate", str(damaged), str(tmp_path / "out")],
                      60)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "metadata.json is unreadable or corrupted" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged"]
