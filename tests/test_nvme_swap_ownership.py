"""Swap files belong to one run: a private locked directory, exclusive 0600 files, no symlink
followed, liveness by lock (never by pid), a per-user default location.

Before, files were named ``zero_swap.r<rank>.pid<pid>.bin`` and opened with O_TRUNC:
two containers whose processes are both pid 1 shared one file and one of them
finished with wrong weights and no error; a dead-looking pid (another pid namespace)
got a live file deleted; a symlink planted at the probe's name was truncated.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

import zero_strategy as zs
import zero_strategy._mechanisms.nvme_files as nvme_files
from _models import TinyLM, batch, loss_fn, param_groups
import _procs



def config(path, nvme=True):
    nv = {"device": "nvme", "path": None if path is None else str(path), "buffer_size": 16384} if nvme else "cpu"
    return zs.ZeroConfig(stage=3, param_persistence_threshold=0, offload_optimizer=nv, offload_params=nv)


def make(path, seed=0, nvme=True):
    torch.manual_seed(seed)
    model = TinyLM(layers=2)
    return zs.setup(model, torch.optim.AdamW(param_groups(model)), config(path, nvme))


def train_step(model, zopt, step):
    tokens, targets = batch(0, step, 0)
    loss_fn(model(tokens), targets).backward()
    zopt.step()
    zopt.zero_grad()


def job_dirs(base):
    return sorted(p for p in Path(base).iterdir() if p.name.startswith("zero_swap-"))


def test_swap_directory_is_private_and_its_file_exclusive(tmp_path):
    model, zopt = make(tmp_path)
    (d,) = job_dirs(tmp_path)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert sorted(p.name for p in d.iterdir()) == ["lock", "swap.bin"]
    assert stat.S_IMODE((d / "swap.bin").stat().st_mode) == 0o600
    owner = zs.api._engine_of(model).swap.file.dir
    with pytest.raises(nvme_files.NVMeError, match=r"cannot create NVMe swap file .*swap\.bin: File exists"):
        owner.create_file("swap.bin", direct=False)  # O_EXCL: never reopened, never truncated
    zs.teardown(model, keep_weights=False)


def test_two_runs_with_the_same_pid_sharing_a_directory_keep_their_own_state(tmp_path):
    """Same process = same pid for both runs: the old naming gave them one file."""
    a, opt_a = make(tmp_path, seed=1)
    b, opt_b = make(tmp_path, seed=2)
    ref_a, ropt_a = make(None, seed=1, nvme=False)
    ref_b, ropt_b = make(None, seed=2, nvme=False)
    assert len(job_dirs(tmp_path)) == 2
    for step in range(3):  # interleaved, as two jobs on one node would be
        for model, opt in ((a, opt_a), (b, opt_b), (ref_a, ropt_a), (ref_b, ropt_b)):
            train_step(model, opt, step)
    for got, want in ((a, ref_a), (b, ref_b)):
        full, ref = zs.full_state_dict(got), zs.full_state_dict(want)
        for k in ref:
            torch.testing.assert_close(full[k], ref[k], rtol=1e-6, atol=1e-7)
    for m in (a, b, ref_a, ref_b):
        zs.teardown(m, keep_weights=False)


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from zero_strategy._mechanisms.nvme_files import JobDir
    d = JobDir(Path(sys.argv[1]), rank=0)
    (d.path / "swap.bin").write_bytes(b"live state of another job")
    print(d.path, flush=True)
    if sys.argv[2] == "hold":
        time.sleep(120)
""")


def _holder(base, mode):
    """A process of another job that creates a swap directory (and holds it, or exits at once)."""
    cmd = [sys.executable, "-c", HOLDER, str(base), mode]
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0:
        cmd = ["unshare", "--pid", "--fork", "--kill-child", *cmd]  # its own pid namespace, as in a container: pid 1
    proc = _procs.start(cmd, stderr=None)
    path = Path(proc.stdout.readline().strip())
    assert path.is_dir(), path
    return proc, path


def _until_unlocked(path: Path, timeout: float = 60.0) -> None:
    """Wait until no process holds ``path``'s lock: a killed holder releases it when the kernel
    has finished it off, which on a loaded machine comes a while after ``kill`` returns (its
    parent, ``unshare``, can be reaped first). The test then asks about a dead job, not a dying one."""
    import fcntl
    deadline = time.monotonic() + timeout
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{path} is still locked {timeout} s after its holder was killed"
                time.sleep(0.05)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
    finally:
        os.close(fd)


@pytest.mark.multiprocess
def test_a_live_directory_of_another_job_is_kept_a_dead_ones_removed(tmp_path):
    proc, live = _holder(tmp_path, "hold")
    try:
        model, zopt = make(tmp_path)
        train_step(model, zopt, 0)
        assert (live / "swap.bin").read_bytes() == b"live state of another job"
        zs.teardown(model, keep_weights=False)
    finally:
        _procs.kill_group(proc)  # unshare and the holder it forked: one process group
        proc.wait()
    _until_unlocked(live)
    with pytest.warns(UserWarning, match=r"removed stale NVMe swap directories .*" + live.name):
        model, zopt = make(tmp_path)
    assert not live.exists()
    zs.teardown(model, keep_weights=False)


@pytest.mark.multiprocess
def test_stale_directory_of_a_dead_run_is_removed_not_read(tmp_path):
    proc, dead = _holder(tmp_path, "exit")
    proc.wait()
    with pytest.warns(UserWarning, match="removed stale NVMe swap directories"):
        model, zopt = make(tmp_path)
    assert not dead.exists()
    train_step(model, zopt, 0)  # its own fresh state
    zs.teardown(model, keep_weights=False)


def test_planted_symlinks_are_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data").write_bytes(b"precious")
    base = tmp_path / "swap"
    base.mkdir()
    # named like a stale swap directory, and like the old path probe of this process
    (base / "zero_swap-local-r0-0123456789abcdef").symlink_to(victim)
    (base / f".zero_strategy_probe.{os.getpid()}").symlink_to(victim / "data")
    model, zopt = make(base)
    train_step(model, zopt, 0)
    zs.teardown(model, keep_weights=False)
    assert (victim / "data").read_bytes() == b"precious"
    assert (base / "zero_swap-local-r0-0123456789abcdef").is_symlink()


def test_a_live_directory_renamed_away_and_replaced_by_a_symlink_costs_nothing_at_teardown(tmp_path):
    """Issue 38: in a base others can write to (no sticky bit), another user renames the live swap
    directory and leaves a symlink to your files in its place; teardown deleted every file there."""
    victim = tmp_path / "home"
    victim.mkdir()
    for name in ("thesis.tex", "data.csv", "notes.txt"):
        (victim / name).write_text("precious")
    base = tmp_path / "swap"
    base.mkdir()
    model, zopt = make(base)
    train_step(model, zopt, 0)
    (live,) = job_dirs(base)
    live.rename(base / "moved")
    live.symlink_to(victim)
    train_step(model, zopt, 1)  # the store keeps its open file: training goes on
    zs.teardown(model, keep_weights=False)
    assert sorted(p.name for p in victim.iterdir()) == ["data.csv", "notes.txt", "thesis.tex"]
    assert all(p.read_text() == "precious" for p in victim.iterdir())
    assert live.is_symlink() and list((base / "moved").iterdir()) == []  # our own files went, by descriptor


def _nfs_flock(real):
    """flock as NFS has it: an exclusive lock needs a descriptor open for writing, else EBADF."""
    def flock(fd, op):
        if op & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real(fd, op)
    return flock


def test_on_nfs_the_swap_directory_is_locked_and_a_dead_one_removed(tmp_path, monkeypatch):
    """Issue 38: locking the directory itself failed on NFS with a raw EBADF, leaving the staging directory."""
    monkeypatch.setattr(fcntl, "flock", _nfs_flock(fcntl.flock))
    dead = nvme_files.JobDir(tmp_path, rank=1)
    for fd in (dead._lock_fd, dead.fd):  # the process that made it died: the kernel closes its files
        os.close(fd)
    with pytest.warns(UserWarning, match="removed stale NVMe swap directories"):
        model, zopt = make(tmp_path)  # its setup sweeps the dead directory away
    train_step(model, zopt, 0)
    (live,) = job_dirs(tmp_path)
    assert nvme_files.remove_stale_job_dirs(tmp_path) == []  # another run's sweep keeps the live one
    zs.teardown(model, keep_weights=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("err", [errno.ENOLCK, errno.EBADF], ids=["ENOLCK", "EBADF"])
def test_a_filesystem_without_locks_warns_naming_the_option_and_leaves_nothing(tmp_path, monkeypatch, err):
    def flock(fd, op):
        raise OSError(err, os.strerror(err))
    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.warns(UserWarning, match=r"cannot lock files .*NVMeOffload\(path=\.\.\.\).*ZERO_STRATEGY_NVME_PATH"):
        model, zopt = make(tmp_path)
    train_step(model, zopt, 0)
    (live,) = job_dirs(tmp_path)
    assert nvme_files.remove_stale_job_dirs(tmp_path) == []  # no lock to ask: never removed by another run
    zs.teardown(model, keep_weights=False)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_setup_leaves_no_staging_directory(tmp_path, monkeypatch):
    def rename(src, dst, **kw):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(nvme_files.NVMeError, match="cannot create a swap directory in .*Input/output error"):
        nvme_files.JobDir(tmp_path, rank=0)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def default_tmp(tmp_path, monkeypatch):
    """The default location under a fresh temp dir, with no path configured anywhere."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("ZERO_STRATEGY_NVME_PATH", raising=False)
    return tmp_path / f"zero_strategy_nvme-{os.geteuid()}"


def test_default_location_is_per_user_and_per_job(default_tmp, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.warns(UserWarning, match=f"NVMe offload without a path uses {default_tmp}"):
        model, zopt = make(None)
    assert stat.S_IMODE(default_tmp.stat().st_mode) == 0o700
    (d,) = job_dirs(default_tmp)
    assert d.name.startswith("zero_swap-4242-r0-")
    zs.teardown(model, keep_weights=False)


def test_default_location_planted_as_a_symlink_is_refused(default_tmp, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    default_tmp.symlink_to(victim)
    with pytest.warns(UserWarning, match="without a path"), \
            pytest.raises(nvme_files.NVMeError, match=r"is not a private directory of this user \(a symlink"):
        make(None)
    assert list(victim.iterdir()) == []


def test_default_location_writable_by_others_is_refused(default_tmp):
    default_tmp.mkdir()
    default_tmp.chmod(0o777)
    with pytest.warns(UserWarning, match="without a path"), \
            pytest.raises(nvme_files.NVMeError, match="writable by others"):
        make(None)
