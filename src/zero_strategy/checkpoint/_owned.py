"""Temporary directories a save (or a consolidation) creates, and only those, get removed.

[Note: what a save may delete]
A save writes into ``<name>.tmp-<token>`` beside the target and moves a previous
checkpoint aside to ``<name>.old-<token>``; ``token`` is 12 random hex digits drawn
for this save. Such a directory is ours only if it carries the marker file
``.zero_strategy_owner`` holding that same token. While the save runs, its rank 0
holds an exclusive ``flock`` on the marker, so another job (or a second save to the
same name) can see that the directory is in use. A directory is removed

* by the save that made it, on success and on every failure path (a full disk, an
  error on another rank, a KeyboardInterrupt), by its exact path; or
* as the leftover of a killed save, by a later save to the same name, only if its
  name matches ``re.escape(name) + r"\\.(tmp|old)-[0-9a-f]{12}"`` exactly, its marker
  holds the token of its name, and the marker's lock can be taken (its owner is gone).

A user's ``ckpt.old-manual-backup/``, another job's in-progress ``run1.tmp-.../`` next
to ``run[1]``, or a symlink planted under a matching name never qualify. The lock is
an advisory ``flock``: on filesystems without it, leftovers are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
from pathlib import Path

MARKER = ".zero_strategy_owner"


class OwnedDir:
    """A directory this process created (or moved aside) and may remove: marker + lock held."""

    def __init__(self, path: Path, token: str, fd: int | None):
        self.path, self.token, self._fd = path, token, fd
        self.kept = False  # became a user's checkpoint (or was put back): never removed

    @classmethod
    def create(cls, parent: Path, name: str, kind: str, token: str | None = None) -> "OwnedDir":
        token = token or secrets.token_hex(6)
        path = parent / f"{name}.{kind}-{token}"
        path.mkdir()  # fails if anything (a directory, a symlink) has that name: never reused
        try:
            return cls(path, token, _mark(path, token))
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise

    @classmethod
    def claim(cls, path: Path, token: str) -> "OwnedDir":
        """Mark an existing directory we are about to move aside (best effort: unmarked if read-only)."""
        try:
            fd = _mark(path, token)
        except OSError:
            fd = None
        return cls(path, token, fd)

    def moved(self, new_path: Path) -> None:
        self.path = new_path

    def unmark(self) -> None:
        """The directory becomes a user's checkpoint: drop the marker, release the lock."""
        self.kept = True
        with contextlib.suppress(OSError):
            os.unlink(self.path / MARKER)
        self.release()

    def remove(self) -> None:
        """Delete the directory (if it is still where we left it) and release the lock."""
        if not self.kept and self.path.is_dir() and not self.path.is_symlink():
            shutil.rmtree(self.path, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing drops the flock
            self._fd = None


def _mark(path: Path, token: str) -> int:
    fd = os.open(path / MARKER, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            os.close(fd)
            raise
    os.write(fd, token.encode())
    return fd


def remove_leftovers(parent: Path, name: str, kinds: tuple[str, ...]) -> list[Path]:
    """Remove leftovers of killed saves of ``name`` (see [Note: what a save may delete])."""
    pattern = re.compile(re.escape(name) + r"\.(" + "|".join(kinds) + r")-([0-9a-f]{12})")
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            fd = os.open(entry / MARKER, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # no marker: not made by a zero_strategy save, never touched
        try:
            if os.read(fd, 64).decode(errors="replace") != m.group(2):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while its owner is alive
        except OSError:
            continue
        else:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            os.close(fd)
    return removed
