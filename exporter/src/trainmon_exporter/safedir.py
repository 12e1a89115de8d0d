"""A directory opened without trusting its path: every component checked on its descriptor.

Owner claims (:mod:`trainmon_exporter.claims`) and the kubelet's pod directory
(:mod:`trainmon_exporter.peers`) decide who owns what on the node, so whoever could change
them could take another user's runs. :class:`TrustedDirectory` opens such a directory from
``/``, one component at a time with ``O_NOFOLLOW``, and judges each on its descriptor
(``fstat``): it must belong to root or this process's user and be writable by nobody else (a
component other than the last may be sticky, as ``/tmp``); the directory itself must not be
writable by group or others at all. The descriptor is kept while the path still names that
directory (an ``lstat`` of the path gives the same inode) and it still passes its own checks;
otherwise the path is walked again.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["TrustedDirectory", "UnsafeDirectory"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirectory(Exception):
    """A directory on the path could be changed by another user, or is a symbolic link."""


class TrustedDirectory:
    """Opens ``path`` (absolute) as the module describes; not thread-safe.

    Attributes:
        trusted: the uids a directory on the path (and a file the caller reads in it) may
            belong to: root and this process's effective uid.
    """

    def __init__(self, path: Path) -> None:
        if not path.is_absolute():
            raise ValueError(f"must be an absolute path: {path}")
        self.path = path
        self._parts = path.parts[1:]
        self.trusted = frozenset({0, os.geteuid()})
        self._fd = -1  # the checked directory, kept while the path still names it
        self._id = (0, 0)  # its (st_dev, st_ino)

    def open(self) -> int | None:
        """The directory's descriptor (owned by this object: do not close it); None if absent.

        Raises:
            UnsafeDirectory: see the class.
            OSError: another error reading a component.
        """
        if self._fd >= 0:
            try:
                st = os.lstat(self.path)
                same = (st.st_dev, st.st_ino) == self._id
            except OSError:
                same = False
            if same:
                self._check(self._fd, self.path.name, last=True)  # raises
                return self._fd
            self.close()
        fd = self._walk()
        if fd is not None:
            st = os.fstat(fd)
            self._fd, self._id = fd, (st.st_dev, st.st_ino)
        return fd

    def close(self) -> None:
        """Forget the kept descriptor (the next :meth:`open` walks the path again)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _walk(self) -> int | None:
        fd = os.open("/", _DIR_FLAGS)
        try:
            self._check(fd, "/", last=not self._parts)
            for i, part in enumerate(self._parts):
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno == errno.ENOENT:
                        return None
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnsafeDirectory(
                            f"{part} in {self.path} is a symbolic link or not a directory"
                        ) from None
                    raise
                os.close(fd)
                fd = nxt
                self._check(fd, part, last=i == len(self._parts) - 1)
            done, fd = fd, -1
            return done
        finally:
            if fd >= 0:
                os.close(fd)

    def _check(self, fd: int, name: str, *, last: bool) -> None:
        st = os.fstat(fd)
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        sticky = st.st_mode & stat.S_ISVTX
        if st.st_uid not in self.trusted or (writable and (last or not sticky)):
            raise UnsafeDirectory(
                f"{name} in {self.path} belongs to uid {st.st_uid} with mode "
                f"{stat.S_IMODE(st.st_mode):04o} (must be root's or this user's, writable by "
                "no one else)"
            )
