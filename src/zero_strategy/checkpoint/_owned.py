"""Temporary directories a save (or a consolidation) creates, and only those, get removed.

[Note: what a save may delete]
A save writes into ``.zero_strategy-save-<token>`` beside the target and moves a previous
checkpoint aside to ``<name>.old-<token>``; ``token`` is 12 random letters ``a-f`` drawn
for this save (hex without a digit: see [Note: names nobody reads a number from]).
Such a directory is ours only if it is a real directory of this user carrying the
marker file ``.zero_strategy_owner`` holding that same token. While the save runs,
its rank 0 holds an exclusive ``flock`` on the marker, so another job (or a second
save) can see that the directory is in use. A directory is removed

* by the save that made it, on success and on every failure path (a full disk, an
  error on another rank, a KeyboardInterrupt), through the descriptor it opened when
  it made (or moved aside) the directory; or
* as the leftover of a killed save, by a later save into the same folder (or
  Lightning's pruning of a checkpoint there), only if its name matches one of the
  exact patterns (``.zero_strategy-save-<token>``, and ``re.escape(name)`` followed by
  ``.tmp-<token>`` or ``.old-<token>``), it is this user's, its marker holds the token
  of its name, and the marker's lock can be taken (its owner is gone).

Removal itself follows no link and goes through one descriptor, whatever the name
points to by then (See [Note: removal never follows a link] in
_mechanisms/owned_dirs.py). A user's ``ckpt.old-manual-backup/``, another job's
in-progress ``run1.tmp-.../`` next to ``run[1]``, or a symlink planted under a matching
name never qualify. On filesystems without locks, leftovers are left alone.

[Note: names nobody reads a number from]
Lightning's SLURM auto-requeue picks the checkpoint to resume from, and the name of
the next one, by reading the digits of every name in ``default_root_dir`` that
contains ``ckpt_``. A temporary directory named after its target
(``hpc_ckpt_2.ckpt.tmp-0a1b...``) read as version 201..., so a save killed mid-way made
every requeued job look for a checkpoint that never existed, and a rank that scanned
while rank 0's save had begun picked another path than rank 0. The save's directory
therefore carries no part of the target's name and no digit, and ``.old-`` tokens
have no digit either: ``hpc_ckpt_1.ckpt.old-<token>`` reads as 1, the checkpoint it
was (and ``load_checkpoint`` finds it there if the save died between its renames).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from pathlib import Path

from .._mechanisms.owned_dirs import open_dir, owned_by_me, remove_tree, try_lock

MARKER = ".zero_strategy_owner"
SAVE_PREFIX = ".zero_strategy-save-"
_TOKEN = r"([0-9a-f]{12})"  # what a name's token may be (saves before issue 38 drew hex digits too)


def new_token() -> str:
    """12 random letters a-f (36 bits). See [Note: names nobody reads a number from]."""
    return "".join(secrets.choice("abcdef") for _ in range(12))


def save_dir(parent: Path, token: str) -> Path:
    """Where the save with ``token`` writes, beside its target."""
    return parent / f"{SAVE_PREFIX}{token}"


def leftover_prefixes(name: str) -> tuple[str, ...]:
    """The name prefixes of directories a killed save of ``name`` may leave."""
    return SAVE_PREFIX, f"{name}.tmp-", f"{name}.old-"


class OwnedDir:
    """A directory this process created (or moved aside) and may remove: open, marked, locked."""

    def __init__(self, path: Path, token: str, dir_fd: int, marker_fd: int | None):
        self.path, self.token = path, token
        self._dir_fd: int | None = dir_fd
        self._marker_fd = marker_fd
        self.kept = False  # became a user's checkpoint (or was put back): never removed

    @classmethod
    def create(cls, parent: Path, prefix: str) -> "OwnedDir":
        """A new directory ``<prefix><token>`` in ``parent``."""
        for _ in range(16):
            token = new_token()
            path = parent / f"{prefix}{token}"
            try:
                path.mkdir()  # fails if anything (a directory, a symlink) has that name: never reused
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"no free name {prefix}<token> in {parent}")
        try:
            fd = open_dir(path)
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(path)  # rmdir never follows a symlink
            raise
        try:
            return cls(path, token, fd, _mark(fd, token))
        except BaseException:
            remove_tree(fd, path)
            os.close(fd)
            raise

    @classmethod
    def claim(cls, path: Path, token: str) -> "OwnedDir":
        """An existing directory we are about to move aside (marked best effort: unmarked if read-only)."""
        fd = open_dir(path)
        try:
            marker = _mark(fd, token)
        except OSError:
            marker = None
        return cls(path, token, fd, marker)

    def moved(self, new_path: Path) -> None:
        self.path = new_path

    def unmark(self) -> None:
        """The directory becomes a user's checkpoint: drop the marker, release the lock."""
        self.kept = True
        if self._dir_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(MARKER, dir_fd=self._dir_fd)
        self.release()

    def remove(self) -> None:
        """Delete the directory we opened (its name only if it still names it); release the lock."""
        if not self.kept and self._dir_fd is not None:
            remove_tree(self._dir_fd, self.path)
        self.release()

    def release(self) -> None:
        for fd in (self._marker_fd, self._dir_fd):  # closing the marker drops the flock
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._marker_fd = self._dir_fd = None


def _mark(dir_fd: int, token: str) -> int:
    fd = os.open(MARKER, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        try_lock(fd)  # a new file: taken, or a filesystem without locks
        os.write(fd, token.encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_leftovers(parent: Path, prefixes: tuple[str, ...]) -> list[Path]:
    """Remove leftovers of killed saves named ``<prefix><token>`` (see [Note: what a save may delete])."""
    pattern = re.compile("(?:" + "|".join(map(re.escape, prefixes)) + ")" + _TOKEN)
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return []
    removed = []
    try:
        for name in os.listdir(parent_fd):
            m = pattern.fullmatch(name)
            if m is not None and _remove_if_dead(parent_fd, parent / name, m.group(1)):
                removed.append(parent / name)
    except OSError:
        pass
    finally:
        os.close(parent_fd)
    return removed


def _remove_if_dead(parent_fd: int, path: Path, token: str) -> bool:
    try:
        fd = open_dir(path.name, dir_fd=parent_fd)  # a symlink or a file: never touched
    except OSError:
        return False
    marker = None
    try:
        if not owned_by_me(fd):
            return False
        # read-write: the lock NFS emulates needs it (See [Note: a lock that works on NFS])
        marker = os.open(MARKER, os.O_RDWR | os.O_NOFOLLOW, dir_fd=fd)
        if os.read(marker, 64).decode(errors="replace") != token or try_lock(marker) is not True:
            return False  # not made by that save, or its owner is alive (or no locks here)
        return remove_tree(fd, path)
    except OSError:
        return False  # no marker: not made by a zero_strategy save, never touched
    finally:
        if marker is not None:
            os.close(marker)
        os.close(fd)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete the checkpoint at ``path`` and what killed saves of it left beside it (Lightning's pruning).

    A directory goes only if it is this user's, through one descriptor (See [Note: removal
    never follows a link]); a file or a symlink is unlinked (never followed).
    """
    path = Path(path).absolute()
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        with contextlib.suppress(OSError):
            fd = open_dir(path)
            try:
                remove_tree(fd, path)
            finally:
                os.close(fd)
    elif mode is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    remove_leftovers(path.parent, leftover_prefixes(path.name))
