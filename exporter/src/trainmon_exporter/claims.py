"""Owner claims: a run's owning uid, registered ahead of its trainers by a privileged process.

A run belongs to the uid whose process opened it first (:meth:`Store.attach
<trainmon_exporter.state.store.Store.attach>`). Where run ids are predictable (``slurm-<job id>``),
another local user could open a run first and keep its real owner out. A batch system's
prolog, which runs as root before the job starts, closes that gap by writing a claim: one
file per run id in a directory only root (or the exporter's user) may write, named after the
run id, holding the owner's uid in decimal (``1234``, a newline allowed). While it exists,
only that uid may attach to the run.

The directory and its files are read without trusting the path:

- the directory is a :class:`~trainmon_exporter.safedir.TrustedDirectory`: every component of
  its path opened ``O_NOFOLLOW`` from ``/`` and judged on its descriptor (root's or this
  exporter's user's, writable by nobody else);
- the claim is opened ``O_NOFOLLOW | O_NONBLOCK`` relative to the directory's descriptor and
  must be a regular file of root or this user, not writable by group or others, of at most
  :data:`MAX_CLAIM_BYTES` bytes, holding one decimal uid.

A claim that fails a check is ignored (the run is first come, first served, as without
claims), logged and counted by reason in :attr:`OwnerClaims.invalid`
(``trainmon_owner_claims_invalid_total``). A missing directory or file is no claim.

The directory's descriptor is kept between look-ups while the path still names it and still
passes its checks; otherwise the path is walked again. Claims themselves are read fresh at each
HELLO, never cached, so a claim written after a squatter connected still wins, and one removed
when the job ends stops counting at once. Look-ups are not thread-safe: the store calls them
under its lock.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import Final

from trainmon_exporter.safedir import TrustedDirectory, UnsafeDirectory

__all__ = ["CLAIM_PROBLEMS", "MAX_CLAIM_BYTES", "OwnerClaims"]

log = logging.getLogger("trainmon_exporter.claims")

MAX_CLAIM_BYTES: Final = 64
"""Largest claim file read; a larger one is ``malformed``."""
MAX_UID: Final = (1 << 32) - 2
"""Largest uid a claim may name (``(uid_t) -1`` is no uid)."""
CLAIM_PROBLEMS: Final = ("unsafe_dir", "unsafe_file", "malformed", "unreadable")
"""Why a claim is ignored: the directory (or a component of its path) could be changed by
another user or is a symbolic link; the claim is a symbolic link, not a regular file, or could
be written by another user; its content is not one decimal uid; reading it failed."""

_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class _Unsafe(Exception):
    def __init__(self, problem: str, detail: str) -> None:
        super().__init__(detail)
        self.problem = problem


class OwnerClaims:
    """Reads owner claims from ``directory``; see the module's description.

    Args:
        directory: absolute path of the claims directory; None: no claims (every look-up
            returns None).

    Attributes:
        invalid: claims ignored so far, by problem (:data:`CLAIM_PROBLEMS`); read under the
            store's lock, as look-ups run under it.
    """

    def __init__(self, directory: Path | None) -> None:
        if directory is not None and not directory.is_absolute():
            raise ValueError(f"owner claims directory must be absolute: {directory}")
        self.directory = directory
        self._dir = None if directory is None else TrustedDirectory(directory)
        self.invalid: dict[str, int] = dict.fromkeys(CLAIM_PROBLEMS, 0)

    def lookup(self, run: str) -> int | None:
        """The uid claimed as ``run``'s owner, or None (no claim, or one that is ignored).

        ``run`` is a valid run id (letters, digits, ``_ . : @ + -``); ``.`` and ``..`` name
        no claim. Never raises: a problem is logged and counted in :attr:`invalid`.
        """
        if self._dir is None or run in (".", "..") or "/" in run or "\0" in run:
            return None
        try:
            dir_fd = self._dir.open()
            return None if dir_fd is None else self._read(dir_fd, run, self._dir.trusted)
        except UnsafeDirectory as exc:
            self.invalid["unsafe_dir"] += 1
            log.warning("owner claim of run %s ignored: %s", run, exc)
        except _Unsafe as exc:
            self.invalid[exc.problem] += 1
            log.warning("owner claim of run %s ignored: %s", run, exc)
        except OSError as exc:
            self.invalid["unreadable"] += 1
            log.warning("owner claim of run %s ignored: %s", run, exc)
        return None

    def _read(self, dir_fd: int, run: str, trusted: frozenset[int]) -> int | None:
        try:
            fd = os.open(run, _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return None
            if exc.errno == errno.ELOOP:
                raise _Unsafe("unsafe_file", "it is a symbolic link") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _Unsafe("unsafe_file", "it is not a regular file")
            if st.st_uid not in trusted or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise _Unsafe(
                    "unsafe_file",
                    f"it belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o} "
                    "(must be root's or this user's, writable by no one else)",
                )
            data = os.read(fd, MAX_CLAIM_BYTES + 1)
        finally:
            os.close(fd)
        text = data.decode("ascii", "replace").strip()
        if len(data) > MAX_CLAIM_BYTES or not text.isdigit() or not text.isascii():
            raise _Unsafe("malformed", f"it holds {data[:32]!r}, not one decimal uid")
        uid = int(text)
        if uid > MAX_UID:
            raise _Unsafe("malformed", f"uid {uid} is out of range")
        return uid
