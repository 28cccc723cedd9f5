"""Where NVMe swap files live, who owns them, and how their space is reserved.

[Note: swap files nobody else can touch]
A swap directory is often shared: a cluster's node-local scratch, ``/tmp``, a path
copied from a colleague's config, two containers whose processes are both pid 1.
So nothing about a swap file is predictable or reused:

* every store (one per rank and run) creates its own directory
  ``<base>/zero_swap-<job>-r<rank>-<16 random hex>`` with mode 0700 (``job``: the
  launcher's job id, for people reading ``ls``; the random part makes it unique);
* files inside are created through the directory's descriptor with ``O_CREAT | O_EXCL |
  O_NOFOLLOW`` and mode 0600, so an existing file or a planted symlink is an error,
  never opened, truncated or followed;
* liveness is an exclusive ``flock`` on the file ``lock`` inside, held by the owning
  process for as long as it runs and dropped by the kernel when it dies however it
  dies (a file opened read-write, so the lock works on NFS too: See [Note: a lock that
  works on NFS] in _mechanisms/owned_dirs.py). A later run removes a directory only if
  it can take that lock (its owner is gone), it is a real directory (not a symlink) of
  the same user, and its name has our pattern. Pids are never consulted: they repeat
  across containers and after reboots. The directory is locked under a temporary name
  and renamed into place, so no live directory is ever visible unlocked. On a
  filesystem without locks a warning names the path option, and stale directories
  there are kept;
* teardown removes the directory through the descriptor opened when it was created,
  so a directory renamed away and replaced by a symlink (a parent others can write to,
  without the sticky bit) costs nothing but our own files (See [Note: removal never
  follows a link] in _mechanisms/owned_dirs.py). A failed setup leaves nothing behind.
* the default base is per user: ``$TMPDIR/zero_strategy_nvme-<uid>``, created 0700 and
  refused if it is a symlink, someone else's, or writable by others.

[Note: reserve the swap space up front]
``posix_fallocate`` reserves this rank's whole swap size at setup (or, where the
filesystem cannot, zeros are written), so a disk too small shows before training,
as an ``NVMeError`` with the path and the free space, not as a failed write-back in
the middle of a step. Regions added later (a larger optimizer state than estimated)
reserve their growth the same way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
import tempfile
import warnings
from pathlib import Path

from .aligned import aligned_empty
from .owned_dirs import open_dir, owned_by_me, remove_tree, try_lock

JOB_DIR_RE = re.compile(r"zero_swap-[A-Za-z0-9_.]{1,64}-r\d{1,7}-[0-9a-f]{16}")
LOCK_FILE = "lock"


class NVMeError(RuntimeError):
    """An NVMe offload path that cannot be used, or an I/O error during training."""


def free_space(path: Path) -> str:
    """``"1.23 GiB free"`` on the filesystem of ``path`` (for error messages)."""
    try:
        return f"{shutil.disk_usage(path).free / 2**30:.2f} GiB free"
    except OSError:
        return "free space unknown"


def job_id() -> str:
    """The launcher's job id, for readable directory names (uniqueness comes from a random token)."""
    for var in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LSB_JOBID", "PBS_JOBID", "JOB_ID"):
        value = os.environ.get(var)
        if value:
            return re.sub(r"[^A-Za-z0-9_.]", "_", value)[:64]
    return "local"


def default_base() -> Path:
    return Path(tempfile.gettempdir()) / f"zero_strategy_nvme-{os.geteuid()}"


def resolve_nvme_path(policy) -> tuple[Path, bool]:
    """The base directory for swap directories, and whether it is the per-user default."""
    if policy is not None and policy.path:
        return Path(policy.path), False
    env = os.environ.get("ZERO_STRATEGY_NVME_PATH")
    if env:
        return Path(env), False
    path = default_base()
    warnings.warn(f"zero_strategy: NVMe offload without a path uses {path}; set nvme path in the config or "
                  "ZERO_STRATEGY_NVME_PATH to a fast local disk (a temp dir may be RAM-backed)", stacklevel=5)
    return path, True


def prepare_base(path: Path, default: bool) -> None:
    """Create the base directory; the shared-/tmp default must be a private directory of this user."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise NVMeError(f"NVMe offload path {path} cannot be created: {e.strerror}; choose a directory "
                        "on a local disk you can write to") from None
    if default:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() \
                or st.st_mode & 0o022:
            raise NVMeError(f"NVMe offload path {path} is not a private directory of this user (a symlink, "
                            "another user's, or writable by others); refusing to put swap files there. "
                            "Remove it, or set an NVMe path in the config or ZERO_STRATEGY_NVME_PATH")
    if not os.access(path, os.W_OK | os.X_OK):
        raise NVMeError(f"NVMe offload path {path} is not writable; choose a directory you can write to")


def check_room(path: Path, needed_bytes: int) -> None:
    """A quick refusal with both numbers before anything is written (fallocate then makes it certain)."""
    free = shutil.disk_usage(path).free
    if free < needed_bytes:
        raise NVMeError(f"NVMe offload path {path} has {free / 2**30:.2f} GiB free but this rank's swap "
                        f"file needs {needed_bytes / 2**30:.2f} GiB; free space or choose another disk")


class JobDir:
    """This store's private, locked directory (see [Note: swap files nobody else can touch])."""

    def __init__(self, base: Path, rank: int):
        token = secrets.token_hex(8)
        self.path = base / f".zero_swap-new-{token}"
        self.fd = self._lock_fd = None
        try:
            self.path.mkdir(mode=0o700)
            self.fd = open_dir(self.path)
            self._lock_fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                                    dir_fd=self.fd)
            if try_lock(self._lock_fd) is None:
                _warn_no_locks(base)
            with contextlib.suppress(OSError):  # the lock versions before issue 38 ask a directory for
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            final = base / f"zero_swap-{job_id()}-r{rank}-{token}"
            os.rename(self.path, final)
            self.path = final
            if not os.path.samestat(os.lstat(final), os.fstat(self.fd)):
                raise OSError(errno.EEXIST, "the directory was replaced while it was created")
        except BaseException as e:
            self.remove()  # nothing left behind, the staging directory included
            if isinstance(e, OSError):
                raise NVMeError(f"cannot create a swap directory in {base}: {e.strerror}") from None
            raise

    def create_file(self, name: str, direct: bool) -> tuple[int, bool]:
        """A new file in the directory: O_EXCL | O_NOFOLLOW, 0600 (O_DIRECT where the filesystem has it),
        created through the directory's descriptor, never through its name."""
        path = self.path / name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        if direct:
            try:
                return os.open(name, flags | os.O_DIRECT, 0o600, dir_fd=self.fd), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise NVMeError(f"cannot create NVMe swap file {path}: {e.strerror}") from None
                with contextlib.suppress(FileNotFoundError):  # some kernels create it before refusing O_DIRECT
                    os.unlink(name, dir_fd=self.fd)
        try:
            return os.open(name, flags, 0o600, dir_fd=self.fd), False
        except OSError as e:
            raise NVMeError(f"cannot create NVMe swap file {path}: {e.strerror}") from None

    def remove(self) -> None:
        """Its files and itself, through the descriptor opened at creation (See [Note: removal never
        follows a link] in _mechanisms/owned_dirs.py); then the lock goes."""
        if self.fd is not None:
            remove_tree(self.fd, self.path)
        for fd in (self._lock_fd, self.fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fd = self._lock_fd = None


_warned_no_locks: set[str] = set()


def _warn_no_locks(base: Path) -> None:
    if str(base) not in _warned_no_locks:
        _warned_no_locks.add(str(base))
        warnings.warn(f"zero_strategy: the NVMe offload path {base} cannot lock files (NFS without its lock "
                      "service?), so a crashed run's swap directory there cannot be told from a live one and is "
                      "never removed; put swap files on a local disk: NVMeOffload(path=...), the config's nvme "
                      "path, or ZERO_STRATEGY_NVME_PATH", stacklevel=6)


def remove_stale_job_dirs(base: Path) -> list[Path]:
    """Swap directories whose owner is gone (their lock is free): removed, never read."""
    removed = []
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return removed
    try:
        names = os.listdir(base_fd)
    except OSError:
        names = []
    for name in names:
        if JOB_DIR_RE.fullmatch(name) and _remove_if_dead(base_fd, base / name):
            removed.append(base / name)
    os.close(base_fd)
    if removed:
        warnings.warn(f"zero_strategy: removed stale NVMe swap directories of runs that ended without "
                      f"cleaning up: {[str(p) for p in removed]}", stacklevel=5)
    return removed


def _remove_if_dead(base_fd: int, path: Path) -> bool:
    try:
        fd = open_dir(path.name, dir_fd=base_fd)  # a symlink: ELOOP/ENOTDIR, never followed
    except OSError:
        return False
    lock = None
    try:
        if not owned_by_me(fd):
            return False
        try:
            lock = os.open(LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW, dir_fd=fd)
        except FileNotFoundError:
            pass  # a directory of a version before issue 38, which locked the directory itself
        if try_lock(lock if lock is not None else fd) is not True:
            return False  # its owner is alive, or this filesystem cannot tell
        return remove_tree(fd, path)
    except OSError:
        return False
    finally:
        if lock is not None:
            os.close(lock)
        os.close(fd)


def reserve(fd: int, path: Path, start: int, end: int) -> None:
    """Bytes [start, end) of the file allocated on disk now. See [Note: reserve the swap space up front]."""
    if end <= start:
        return
    try:
        os.posix_fallocate(fd, start, end - start)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise NVMeError(_no_room(path, end - start, e)) from None
    # the filesystem cannot fallocate: write zeros (aligned, for O_DIRECT)
    zeros = aligned_empty(min(end - start, 16 << 20), pin=False).zero_()
    view = memoryview(zeros.numpy())
    at = start
    try:
        while at < end:
            n = os.pwrite(fd, view[:min(len(view), end - at)], at)
            at += n
    except OSError as e:
        raise NVMeError(_no_room(path, end - start, e)) from None


def _no_room(path: Path, nbytes: int, e: OSError) -> str:
    what = "the disk is full" if e.errno == errno.ENOSPC else e.strerror
    return (f"cannot reserve {nbytes / 2**30:.2f} GiB for the NVMe swap file {path}: {what} "
            f"({free_space(path.parent)} there); free space or choose another disk")
