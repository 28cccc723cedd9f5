"""Directories this process owns: a lock that says "alive", and removal that follows no link.

[Note: removal never follows a link]
Swap directories and checkpoint leftovers sit in directories other people can often
write to (a cluster's scratch, a shared checkpoint folder). There, between the moment
a directory is created and the moment it is removed, anyone with write access to its
parent can rename it away and leave a symlink (or another of our own directories) under
its name; a removal that goes by the name then deletes the files at the link's target
(issue 38: every file of the target, 3 of 3). So every removal goes through
:func:`remove_tree`:

* the directory is opened once, ``O_DIRECTORY | O_NOFOLLOW`` (a symlink fails to
  open), when it is created, claimed or found, and it must belong to this user;
* its contents are deleted through that descriptor (``os.fwalk`` with ``dir_fd``,
  ``unlink``/``rmdir`` relative to each directory's descriptor), so what is deleted is
  what is inside *that* directory, wherever its name now points;
* the name is removed last, and only while it still names that same directory
  (``st_dev``/``st_ino`` compared with the open descriptor).

Nothing is ever deleted by a pattern: callers find candidates by an exact name
pattern, then prove each one theirs (a marker or a lock) before handing it here.

[Note: a lock that works on NFS]
Liveness is an exclusive ``flock`` held by the owner and dropped by the kernel when it
dies. It is taken on a regular file opened read-write, never on a directory: NFS
emulates ``flock`` with a server-side POSIX lock, which needs a descriptor open for
writing (a directory's fails with EBADF). Where a filesystem has no locks at all
(``ENOLCK``: NFS mounted without its lock service), :func:`try_lock` says so, and
callers treat every directory there as alive: kept, never removed by someone else.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path

__all__ = ["NO_LOCKS", "open_dir", "owned_by_me", "remove_tree", "try_lock"]

#: errors of a filesystem that cannot lock (EBADF: NFS asked for a write lock through a read-only descriptor)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def open_dir(name: str | os.PathLike, dir_fd: int | None = None) -> int:
    """A descriptor of the directory ``name`` itself; OSError if it is a symlink or not a directory."""
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def owned_by_me(fd: int) -> bool:
    st = os.fstat(fd)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def try_lock(fd: int) -> bool | None:
    """Take an exclusive ``flock`` without waiting: True taken, False held by a live owner,
    None on a filesystem without locks. See [Note: a lock that works on NFS]."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in NO_LOCKS:
            return None
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def remove_tree(fd: int, path: Path) -> bool:
    """Remove the directory open as ``fd``, last known as ``path``. See [Note: removal never follows a link].

    Its contents go through ``fd``; the name ``path`` goes only while it still names that
    directory. Returns whether the name was removed. Never raises for a file that vanished
    or could not be removed (what is left stays where it is); ``fd`` stays open.
    """
    if not owned_by_me(fd):
        return False
    _empty(fd)
    try:
        parent = open_dir(path.parent)
    except OSError:
        return False
    try:
        st = os.stat(path.name, dir_fd=parent, follow_symlinks=False)
        if not os.path.samestat(st, os.fstat(fd)):
            return False  # renamed away: its (now empty) directory stays where it was moved
        os.rmdir(path.name, dir_fd=parent)
        return True
    except OSError:
        return False
    finally:
        os.close(parent)


def _empty(fd: int) -> None:
    """Delete everything inside the directory open as ``fd``, deepest first, following no link."""
    with contextlib.suppress(OSError):
        for _, dirs, files, root_fd in os.fwalk(".", topdown=False, follow_symlinks=False, dir_fd=fd):
            for name in files + dirs:  # a symlink to a directory is listed in dirs: unlinked, not entered
                with contextlib.suppress(OSError):
                    if stat.S_ISDIR(os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mode):
                        os.rmdir(name, dir_fd=root_fd)
                    else:
                        os.unlink(name, dir_fd=root_fd)
