"""The ingest socket file: created, probed, checked and removed without trusting its path.

The socket is the trust boundary between the exporter and every local process, so the path
it lives at is treated as hostile ground:

- The socket's directory is opened once (``O_DIRECTORY | O_NOFOLLOW``) and judged on that
  descriptor: it must belong to this user or root, and be writable by nobody else unless it
  is sticky and belongs to this user (``/tmp``-like directories owned by root are refused to a
  non-root exporter). Every later look-up, unlink and probe goes through the descriptor.
- A lock file next to the socket (``<socket>.lock``, ``flock``) is held for the exporter's
  life, so of several exporters started on one path exactly one goes on; the others stop
  before they touch the path. The lock file is removed while held, on a clean stop.
- An existing socket file is probed with a non-blocking ``connect``: ``ECONNREFUSED`` means
  nobody listens (a killed exporter's leftover, which is removed); success, ``EAGAIN`` (a live
  exporter whose listen queue is full) or another socket type mean someone listens, and the
  file is left alone.
- ``bind()`` creates the file owner-only: Linux gives the new file the socket's own mode less
  the umask, and the socket's mode is set with ``fchmod`` before ``bind``. The group and the
  final mode are then set through an ``O_PATH | O_NOFOLLOW`` descriptor of the new file, after
  checking that it is a socket of this user: no operation by path that could follow a link.
- :meth:`IngestSocket.problem` compares the path's inode with the one bound, for ``/readyz``.

Linux only (``O_PATH``, ``/proc/self/fd``), as the rest of ingest (``SO_PEERCRED``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path

from trainmon_client import _env

MAX_PATH_BYTES = 107
"""Longest Unix socket path Linux accepts (``sun_path`` is 108 bytes with the NUL)."""
BACKLOG = 128
"""Listen queue length of the ingest socket."""
LOCK_SUFFIX = ".lock"


class SocketSetupError(Exception):
    """The ingest socket cannot be created; the message is one line for the user."""


class SocketInUseError(SocketSetupError):
    """Another process listens on the socket path, or another exporter holds its lock."""


class UnsafeSocketDirError(SocketSetupError):
    """The socket's directory could be changed by another user (or is a symbolic link)."""


def suggested_path() -> str:
    """A socket path this user could use: ``/run/trainmon`` as root, else the runtime dir.

    The runtime directory only where it is this user's own
    (:func:`trainmon_client._env.runtime_dir_problem`): never one another user could change.
    """
    if os.geteuid() == 0:
        return _env.DEFAULT_SOCKET
    runtime, _ = _env.runtime_socket(os.environ)
    if runtime:
        return runtime
    return "~/.trainmon/trainmon.sock (a directory this user owns and no one else can write)"


def _hint(parent: Path | None = None) -> str:
    """Where else the socket could go; never into ``parent``, the directory found wanting."""
    suggestion = suggested_path()
    if parent is not None and os.path.dirname(suggestion) == os.fspath(parent):
        suggestion = "in a directory this user owns and no one else can write"
    else:
        suggestion = f"e.g. {suggestion}"
    return f"pass --socket PATH (or TRAINMON_SOCKET), {suggestion}"


def alternative_path(shown: Path) -> Path:
    """A free sibling of ``shown`` for a second exporter: ``trainmon-2.sock``, ``-3``..."""
    for n in range(2, 100):
        candidate = shown.with_name(f"{shown.stem}-{n}{shown.suffix}")
        if not os.path.lexists(candidate):
            return candidate
    return shown.with_name(f"{shown.stem}-{os.getpid()}{shown.suffix}")


def _elsewhere(shown: Path) -> str:
    """How to run this exporter beside the one that holds ``shown``."""
    alt = alternative_path(shown)
    return (
        f"or run this one on another path: --socket {alt} (and TRAINMON_SOCKET={alt} for its "
        "trainers)"
    )


def _peer(sock: socket.socket) -> tuple[int, int] | None:
    """``(pid, uid)`` of the listener ``sock`` is connected to (``SO_PEERCRED``), or None."""
    try:
        pid, uid, _gid = struct.unpack(
            "3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        )
    except OSError:
        return None
    return pid, uid


def _not_ours(shown: Path, uid: int, pid: int | None) -> SocketInUseError:
    """The error for a listener of another user on the exporter's path."""
    euid = os.geteuid()
    who = f"uid {uid}" + (f", pid {pid}" if pid else "")
    return SocketInUseError(
        f"{shown} is held by a process of {who}, not a trainmon exporter of this user (uid "
        f"{euid}): trainers with TRAINMON_EXPORTER_UID={euid} refuse it and others would send "
        f"it their metrics; stop that process, remove {shown}, and let only uid {euid} write "
        f"{shown.parent} (not mode 1777)"
    )


def directory_problem(st: os.stat_result, euid: int | None = None) -> str | None:
    """Why a directory with this ``fstat`` result is unsafe for the socket, or None.

    Safe: owned by this user or root, and writable by no one else, or sticky and owned by this
    user (others may then add files but not rename or remove the exporter's).
    """
    euid = os.geteuid() if euid is None else euid
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (euid, 0):
        return f"belongs to uid {st.st_uid}, who could replace the socket"
    if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and st.st_uid == euid):
        return (
            f"is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}), who could "
            "replace the socket; it must be writable only by this user, or sticky and owned "
            "by it"
        )
    return None


def open_directory(parent: Path) -> int:
    """Open (creating if needed, mode 0755) and check the socket's directory; returns its fd.

    Raises:
        UnsafeSocketDirError: it is a symbolic link, not a directory, or others can write it.
        SocketSetupError: it cannot be created or opened.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    created = False
    try:
        try:
            fd = os.open(parent, flags)
        except FileNotFoundError:
            os.makedirs(parent.parent, exist_ok=True)
            try:
                os.mkdir(parent, 0o755)
                created = True
            except FileExistsError:
                pass
            fd = os.open(parent, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeSocketDirError(
                f"socket directory {parent} is a symbolic link or not a directory; {_hint(parent)}"
            ) from None
        raise SocketSetupError(
            f"cannot create the socket directory {parent} ({exc.strerror}); {_hint(parent)}"
        ) from None
    try:
        st = os.fstat(fd)
        if created and st.st_uid == os.geteuid():
            # Trainers of other users must reach the socket; its own mode decides who may
            # connect. A set-group-ID bit inherited from the parent is kept (the socket then
            # takes the directory's group: Kubernetes fsGroup volumes).
            os.fchmod(fd, 0o755 | (st.st_mode & stat.S_ISGID))
            st = os.fstat(fd)
        problem = directory_problem(st)
        if problem:
            raise UnsafeSocketDirError(f"socket directory {parent} {problem}; {_hint(parent)}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _own(fd: int, kind: Callable[[int], bool]) -> os.stat_result | None:
    """``fstat`` of ``fd`` if it is of ``kind`` (e.g. ``stat.S_ISSOCK``) and this user's."""
    st = os.fstat(fd)
    return st if kind(st.st_mode) and st.st_uid == os.geteuid() else None


def _via(dirfd: int, name: str) -> str:
    """A path that reaches ``name`` inside the already-opened directory ``dirfd``."""
    return f"/proc/self/fd/{dirfd}/{name}"


def probe(dirfd: int, name: str, shown: Path) -> str:
    """What is at ``name`` in ``dirfd``: ``"absent"``, ``"stale"`` (a socket nobody listens on).

    Never blocks: the connect is non-blocking, so a listener whose queue is full answers
    ``EAGAIN`` at once instead of hanging the caller.

    Raises:
        SocketInUseError: something listens there, or it is not a socket, or it cannot be
            probed (then it is left alone too). ``shown`` is the path named in the message.
    """
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return "absent"
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUseError(
            f"{shown} exists and is not a socket; remove it, {_elsewhere(shown)}"
        )
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.setblocking(False)
        s.connect(_via(dirfd, name))
    except ConnectionRefusedError:
        return "stale"
    except FileNotFoundError:
        return "absent"
    except BlockingIOError:  # EAGAIN: a listener whose queue is full is alive
        if st.st_uid != os.geteuid():  # no SO_PEERCRED without a connection: the file's owner
            raise _not_ours(shown, st.st_uid, None) from None
        raise SocketInUseError(
            f"another exporter is listening on {shown} (its queue is full); stop it, "
            f"{_elsewhere(shown)}"
        ) from None
    except OSError as exc:
        if exc.errno == errno.EPROTOTYPE:
            raise SocketInUseError(
                f"another program listens on {shown} (not a trainmon socket); stop it, "
                f"{_elsewhere(shown)}"
            ) from None
        raise SocketInUseError(
            f"cannot tell whether anyone listens on {shown} ({exc.strerror}); it is left alone: "
            f"remove it, {_elsewhere(shown)}"
        ) from None
    else:
        peer = _peer(s)  # connected: the listener's own credentials, from the kernel
    finally:
        s.close()
    uid = peer[1] if peer is not None else st.st_uid
    pid = peer[0] if peer is not None else None
    if uid != os.geteuid():
        raise _not_ours(shown, uid, pid)
    who = f" (pid {pid})" if pid else ""
    raise SocketInUseError(
        f"another exporter{who} is listening on {shown}; stop it, {_elsewhere(shown)}"
    )


def _lock(dirfd: int, name: str, shown: Path) -> int:
    """Take ``<name>.lock`` in ``dirfd`` (``flock``, not waiting); returns the held fd."""
    lock = name + LOCK_SUFFIX
    for _ in range(8):
        try:
            fd = os.open(
                lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dirfd
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeSocketDirError(f"{shown}{LOCK_SUFFIX} is a symbolic link") from None
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise SocketSetupError(
                    f"socket directory {shown.parent} is not writable by this user "
                    f"({exc.strerror}); {_hint(shown.parent)}"
                ) from None
            raise
        try:
            st = _own(fd, stat.S_ISREG)
            if st is None:
                owner = os.fstat(fd).st_uid
                euid = os.geteuid()
                whose = (
                    f"belongs to uid {owner}, not to this user (uid {euid}): not a trainmon "
                    f"exporter's lock; remove it, and let only uid {euid} write {shown.parent}"
                    if owner != euid
                    else "is not a regular file; remove it if no exporter runs"
                )
                raise UnsafeSocketDirError(f"{shown}{LOCK_SUFFIX} {whose}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                who = f" (pid {holder})" if holder.isdigit() else ""
                raise SocketInUseError(
                    f"another exporter{who} is starting or running on {shown}; stop it, "
                    f"{_elsewhere(shown)}"
                ) from None
            try:
                now = os.stat(lock, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # its holder removed it as we opened it: take the new one
    raise SocketInUseError(f"the lock of {shown} keeps changing; is another exporter looping?")


class IngestSocket:
    """A listening ``SOCK_SEQPACKET`` socket bound at ``path``, with its directory and lock.

    Create with :meth:`create`; :meth:`close` stops listening and removes the file (only if
    the path still is this socket) and the lock.

    Attributes:
        sock: the listening socket (non-blocking).
        path: the socket file.
        identity: ``(st_dev, st_ino)`` of the file ``bind()`` created.
    """

    def __init__(
        self, sock: socket.socket, path: Path, dirfd: int, lockfd: int, ident: tuple[int, int]
    ) -> None:
        self.sock = sock
        self.path = path
        self.identity = ident
        self._dirfd = dirfd
        self._lockfd = lockfd

    @classmethod
    def create(cls, path: Path, mode: int = 0o660, gid: int | None = None) -> IngestSocket:
        """Check the directory, take the lock, remove a stale socket, bind and listen.

        Args:
            path: the socket file (at most :data:`MAX_PATH_BYTES` bytes).
            mode: permissions of the file (the owner must have read and write).
            gid: group of the file; None keeps the default (this user's group, or the
                directory's when it is set-group-ID).

        Raises:
            SocketInUseError: someone listens at ``path`` or another exporter holds its lock.
            UnsafeSocketDirError: the directory could be changed by another user.
            SocketSetupError: any other reason, one line (e.g. a full disk).
        """
        if len(os.fsencode(path)) > MAX_PATH_BYTES:
            raise SocketSetupError(
                f"socket path {path} is longer than the {MAX_PATH_BYTES} bytes Unix sockets "
                "allow; pass a shorter --socket PATH"
            )
        name = path.name
        try:
            dirfd = open_directory(path.parent)
        except OSError as exc:
            raise SocketSetupError(_os_error(path, exc)) from None
        lockfd = -1
        sock: socket.socket | None = None
        try:
            lockfd = _lock(dirfd, name, path)
            if probe(dirfd, name, path) == "stale":
                os.unlink(name, dir_fd=dirfd)  # nobody listens: a killed exporter's leftover
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            os.fchmod(sock.fileno(), 0o600)  # bind() creates the file with this mode
            _bind(sock, path)
            ident = _finish_file(dirfd, name, path, mode, gid)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except BaseException as exc:
            if sock is not None:
                sock.close()
            if lockfd >= 0:
                os.close(lockfd)
            os.close(dirfd)
            if isinstance(exc, OSError):
                raise SocketSetupError(_os_error(path, exc)) from None
            raise
        return cls(sock, path, dirfd, lockfd, ident)

    def problem(self) -> str | None:
        """Why the path no longer leads to this socket (deleted, replaced), or None."""
        if self._dirfd < 0:
            return "the ingest socket is closed"
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return f"socket file {self.path} was deleted: trainers cannot connect"
        except OSError as exc:
            return f"cannot check socket file {self.path}: {exc.strerror}"
        if (st.st_dev, st.st_ino) != self.identity:
            return (
                f"socket file {self.path} was replaced by another file: trainers no longer "
                "reach this exporter"
            )
        return None

    def close(self) -> None:
        """Stop listening; remove the file if it still is this socket; release the lock."""
        if self._dirfd < 0:
            return
        self.sock.close()
        name = self.path.name
        try:
            st = os.stat(name, dir_fd=self._dirfd, follow_symlinks=False)
            if (st.st_dev, st.st_ino) == self.identity:
                os.unlink(name, dir_fd=self._dirfd)
        except OSError:
            pass  # already gone or replaced: someone else's file now, left alone
        try:
            os.unlink(name + LOCK_SUFFIX, dir_fd=self._dirfd)  # while still holding it
        except OSError:
            pass
        os.close(self._lockfd)
        os.close(self._dirfd)
        self._dirfd = self._lockfd = -1


def _bind(sock: socket.socket, path: Path) -> None:
    """``bind()`` at the real path (what ``ss -x`` and trainers show); checked right after."""
    sock.bind(os.fspath(path))


def _finish_file(dirfd: int, name: str, path: Path, mode: int, gid: int | None) -> tuple[int, int]:
    """Give the just-bound file its group and mode through a descriptor; returns its identity.

    The file is opened ``O_PATH | O_NOFOLLOW`` relative to the checked directory and must be a
    socket of this user: a symbolic link or another file swapped in after ``bind()`` is never
    changed. ``chown``/``chmod`` of ``/proc/self/fd/N`` act on the opened inode itself.
    """
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        st = _own(fd, stat.S_ISSOCK)
        if st is None:
            raise SocketSetupError(
                f"{path} was replaced by another file while the exporter created it; "
                "someone else can write its directory"
            )
        via = f"/proc/self/fd/{fd}"
        if gid is not None and gid != st.st_gid:
            try:
                os.chown(via, -1, gid)
            except PermissionError:
                raise SocketSetupError(
                    f"cannot give {path} to group {gid}: this user is not a member of it "
                    "(--socket-group)"
                ) from None
        os.chmod(via, mode)
        return (st.st_dev, st.st_ino)
    finally:
        os.close(fd)


def _os_error(path: Path, exc: OSError) -> str:
    """One line for an ``OSError`` while creating the socket (full disk, permissions...)."""
    if exc.errno == errno.EADDRINUSE:
        return f"{path} appeared while the exporter created it (another exporter?)"
    return f"cannot create the ingest socket {path}: {exc.strerror or exc}"
