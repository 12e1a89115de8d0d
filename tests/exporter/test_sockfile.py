"""The ingest socket file under hostile conditions: links, unsafe directories, live or full
listeners, deletion, simultaneous starts and a full disk."""

from __future__ import annotations

import asyncio
import errno
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from trainmon_client._env import runtime_dir_problem
from trainmon_exporter.ingest import IngestMetrics, IngestServer
from trainmon_exporter.sockfile import (
    IngestSocket,
    SocketInUseError,
    UnsafeSocketDirError,
    suggested_path,
)

from ..conftest import (
    ExporterProcess,
    InProcessExporter,
    connect,
    free_port,
    short_tmpdir,
    wait_for,
)
from ..helpers.exporter import store_of

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown to another uid)")


@pytest.fixture
def tmpdir_short() -> Iterator[Path]:
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def clean_env() -> dict[str, str]:
    """The environment without TRAINMON_* variables (each unknown one is a warning line)."""
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("TRAINMON_")}


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainmon_exporter", "--listen", f"127.0.0.1:{free_port()}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=clean_env(),
    )


def one_line_exit_2(out: subprocess.CompletedProcess[str]) -> str:
    """The start-up contract: exit code 2 and one line on stderr, never a traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("trainmon-exporter: error: ")
    return out.stderr


# --------------------------------------------------------------------------- links


def other_group() -> int:
    """A group the socket can be given to other than this user's own: any for root, else one
    of this user's supplementary groups (skips when it has none)."""
    if os.geteuid() == 0:
        return 43100
    others = sorted(set(os.getgroups()) - {os.getegid()})
    if not others:
        pytest.skip("needs root or a user with a second group (chown to a group of its own)")
    return others[0]


@pytest.mark.uid
@pytest.mark.parametrize("group", [None, "other"])
def test_a_link_swapped_in_after_bind_changes_nothing(
    tmpdir_short: Path, monkeypatch: pytest.MonkeyPatch, group: str | None
) -> None:
    """The race: after bind() and before the mode is set, the socket's name is swapped for a
    link to a file only its owner may read. Driven deterministically: the swap happens inside
    the very chmod/chown call that used to follow the link."""
    gid = None if group is None else other_group()
    secret = tmpdir_short / "secret"
    secret.write_text("root only")
    secret.chmod(0o600)
    before = secret.stat()
    path = tmpdir_short / "t.sock"
    real_chmod, real_chown = os.chmod, os.chown
    calls: list[str] = []

    def swap_then(real: Callable[..., None]) -> Callable[..., None]:
        def racing(target: Any, *args: Any, **kwargs: Any) -> None:
            calls.append(os.fspath(target))
            if not path.is_symlink():
                path.rename(tmpdir_short / "moved.sock")
                path.symlink_to(secret)
            real(target, *args, **kwargs)

        return racing

    monkeypatch.setattr(os, "chmod", swap_then(real_chmod))
    monkeypatch.setattr(os, "chown", swap_then(real_chown))
    extra = {} if gid is None else {"group": gid}
    server = IngestServer(path, store_of(), IngestMetrics(CollectorRegistry()), 0o666, **extra)

    async def start_and_check() -> str | None:
        server.start()
        try:
            after = secret.stat()
            assert stat.S_IMODE(after.st_mode) == 0o600
            assert (after.st_uid, after.st_gid) == (before.st_uid, before.st_gid)
            return server.socket_problem()
        finally:
            server.close()

    problem = asyncio.run(start_and_check())
    assert secret.read_text() == "root only" and path.is_symlink()  # close() left it alone
    assert calls and all(c.startswith("/proc/self/fd/") for c in calls)  # never by path
    assert problem is not None and "replaced" in problem  # and /readyz would say so


def test_a_link_at_the_lock_path_is_refused(tmpdir_short: Path) -> None:
    secret = tmpdir_short / "secret"
    secret.write_text("x")
    secret.chmod(0o600)
    (tmpdir_short / "t.sock.lock").symlink_to(secret)
    with pytest.raises(UnsafeSocketDirError, match="symbolic link"):
        IngestSocket.create(tmpdir_short / "t.sock")
    assert secret.read_text() == "x" and stat.S_IMODE(secret.stat().st_mode) == 0o600


def test_the_socket_is_created_with_its_mode_and_group(tmpdir_short: Path) -> None:
    old = os.umask(0)  # a permissive umask must not widen the socket
    try:
        s = IngestSocket.create(tmpdir_short / "a" / "t.sock", 0o660, None)
    finally:
        os.umask(old)
    try:
        st = os.lstat(s.path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert stat.S_IMODE(os.stat(tmpdir_short / "a").st_mode) == 0o755  # created for it
        assert (st.st_dev, st.st_ino) == s.identity and s.problem() is None
    finally:
        s.close()
    assert not s.path.exists() and not (tmpdir_short / "a" / "t.sock.lock").exists()


# --------------------------------------------------------------------------- directories


def _dir(base: Path, mode: int, owner: int | None = None) -> Path:
    """A directory of ``owner`` (default: this user) with ``mode``."""
    d = base / f"d{mode:o}-{owner}"
    d.mkdir()
    if owner is not None:
        os.chown(d, owner, owner)  # another uid: root only
    d.chmod(mode)
    return d


@pytest.mark.uid
@pytest.mark.parametrize(
    ("mode", "owner", "why"),
    [
        (0o777, None, "writable by other users"),
        (0o775, None, "writable by other users"),
        pytest.param(0o1777, 43001, "belongs to uid 43001", marks=as_root),
        pytest.param(0o755, 43001, "belongs to uid 43001", marks=as_root),
    ],
)
def test_a_directory_others_could_change_is_refused(
    tmpdir_short: Path, mode: int, owner: int | None, why: str
) -> None:
    d = _dir(tmpdir_short, mode, owner)
    err = one_line_exit_2(cli("--socket", str(d / "t.sock")))
    assert why in err and "--socket" in err
    # Never suggests a directory another user could change: root's node-wide path, or this
    # user's own runtime directory (owned by it, 0700), wherever that is (the suite's lies in
    # the temporary directory).
    suggested = re.search(r"e\.g\. (\S+)", err)
    if suggested is not None:
        assert suggested[1] == suggested_path().split()[0], err
        if os.geteuid() != 0 and not suggested[1].startswith("~"):
            runtime = Path(suggested[1]).parent.parent
            assert runtime_dir_problem(str(runtime)) is None, err
    assert not (d / "t.sock").exists()


@pytest.mark.uid
def test_a_sticky_directory_of_this_user_is_accepted(tmpdir_short: Path) -> None:
    d = _dir(tmpdir_short, 0o1777)
    s = IngestSocket.create(d / "t.sock")
    s.close()


def test_a_symlinked_directory_is_refused(tmpdir_short: Path) -> None:
    real = tmpdir_short / "real"
    real.mkdir()
    (tmpdir_short / "link").symlink_to(real)
    with pytest.raises(UnsafeSocketDirError, match="symbolic link"):
        IngestSocket.create(tmpdir_short / "link" / "t.sock")
    assert list(real.iterdir()) == []


# --------------------------------------------------------------------------- who listens


def test_a_live_exporter_with_a_full_queue_is_not_waited_on(tmpdir_short: Path) -> None:
    """A second exporter used to block forever in connect() on a full listen queue."""
    path = tmpdir_short / "t.sock"
    live = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    live.bind(str(path))
    live.listen(0)
    queued = []
    while True:  # fill the queue: the next connect would block
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c.setblocking(False)
        try:
            c.connect(str(path))
        except BlockingIOError:
            c.close()
            break
        queued.append(c)
    try:
        t0 = time.monotonic()
        err = one_line_exit_2(cli("--socket", str(path), timeout=20))
        assert "listening" in err and time.monotonic() - t0 < 15
        assert stat.S_ISSOCK(os.lstat(path).st_mode)  # never unlinked
    finally:
        for c in queued:
            c.close()
        live.close()


@pytest.mark.parametrize("kind", ["stream", "file"])
def test_something_else_at_the_path_is_left_alone(tmpdir_short: Path, kind: str) -> None:
    path = tmpdir_short / "t.sock"
    other = None
    if kind == "stream":
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(str(path))
        other.listen()
    else:
        path.write_text("data")
    try:
        err = one_line_exit_2(cli("--socket", str(path)))
        assert ("another program" if kind == "stream" else "not a socket") in err
        assert path.exists() and (kind == "stream" or path.read_text() == "data")
    finally:
        if other is not None:
            other.close()


def test_six_exporters_started_at_once_one_wins(
    tmpdir_short: Path, exporter_process: Callable[..., ExporterProcess]
) -> None:
    """Simultaneous starts over a stale socket: one serves, five exit 2 with one line each,
    and nobody removes the winner's socket."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(tmpdir_short / "t.sock"))
    stale.close()
    exps = [exporter_process(socket_dir=tmpdir_short, env=clean_env()) for _ in range(6)]
    procs = []
    for ex in exps:
        ex.start(wait=False)
        assert ex.proc is not None
        procs.append(ex.proc)

    def settled() -> bool:
        done = [p for p in procs if p.poll() is not None]
        try:
            return len(done) == 5 and all(ex.ready() for ex in exps if ex.proc not in done)
        except AssertionError:  # ready() of one that just exited
            return False

    wait_for(settled, timeout=60, interval=0.2)
    (winner,) = [ex for ex in exps if ex.proc is not None and ex.proc.poll() is None]
    for ex in exps:
        if ex is winner:
            continue
        assert ex.proc is not None
        out, _ = ex.proc.communicate(timeout=10)  # reads and closes the pipe
        assert ex.proc.returncode == 2, out
        assert out.count("\n") == 1 and "another exporter" in out and "Traceback" not in out
    run = connect(winner, "after-the-race")
    run.log(1, loss=1.0)
    run.finish()
    wait_for(lambda: any(r["run"] == "after-the-race" for r in winner.runs()["runs"]))


# --------------------------------------------------------------------------- /readyz


def test_readyz_notices_the_socket_deleted_or_replaced(exporter: InProcessExporter) -> None:
    assert exporter.client.get("/readyz").status_code == 200
    path = Path(exporter.socket)
    path.unlink()
    r = exporter.client.get("/readyz")
    assert r.status_code == 503 and "deleted" in r.json()["reason"]
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    impostor.bind(str(path))  # someone else's socket at our path
    impostor.listen()
    try:
        r = exporter.client.get("/readyz")
        assert r.status_code == 503 and "replaced" in r.json()["reason"]
        assert "replaced" in exporter.client.get("/").text  # the status page says so too
    finally:
        impostor.close()


# --------------------------------------------------------------------------- full disk


@pytest.fixture
def tiny_tmpfs(tmpdir_short: Path) -> Iterator[Callable[[int], Path]]:
    """A tmpfs with ``n`` inodes (the root directory takes one)."""
    mounted: list[Path] = []

    def mount(inodes: int) -> Path:
        where = tmpdir_short / f"fs{inodes}"
        where.mkdir()
        opts = f"size=64k,nr_inodes={inodes},mode=0755"
        out = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs to fill (needs CAP_SYS_ADMIN): {out.stderr}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize(("inodes", "fails_at"), [(1, "lock"), (2, "bind")])
def test_a_full_disk_is_one_line(
    tiny_tmpfs: Callable[[int], Path], inodes: int, fails_at: str
) -> None:
    fs = tiny_tmpfs(inodes)
    if fails_at == "bind":  # prove the lock fits and the socket does not
        (fs / "t.sock.lock").touch()
        with pytest.raises(OSError) as exc:
            (fs / "other").touch()
        assert exc.value.errno == errno.ENOSPC
        (fs / "t.sock.lock").unlink()
    err = one_line_exit_2(cli("--socket", str(fs / "t.sock")))
    assert "No space left on device" in err


# --------------------------------------------------------------------------- in use


def test_a_live_socket_is_never_unlinked(tmpdir_short: Path) -> None:
    first = IngestSocket.create(tmpdir_short / "t.sock")
    try:
        with pytest.raises(SocketInUseError):
            IngestSocket.create(tmpdir_short / "t.sock")
        # Without the lock (an exporter of another version, or another program): the probe.
        os.unlink(tmpdir_short / "t.sock.lock")
        with pytest.raises(SocketInUseError, match="listening"):
            IngestSocket.create(tmpdir_short / "t.sock")
        assert first.problem() is None
    finally:
        first.close()


# --------------------------------------------------------------------------- whose listener


def test_a_second_exporter_is_told_of_another_path_not_the_same_one(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    first = exporter_process().start()
    out = subprocess.run(
        [sys.executable, "-m", "trainmon_exporter", "--socket", first.socket],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    alt = str(Path(first.socket).with_name("t-2.sock"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert first.proc is not None and f"another exporter (pid {first.proc.pid}) is" in out.stderr
    assert f"--socket {alt} (and TRAINMON_SOCKET={alt} for its trainers)" in out.stderr
    assert f"--socket {first.socket} " not in out.stderr  # never the path in conflict


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv"
)
def test_a_listener_of_another_user_is_named_as_not_ours(tmpdir_short: Path) -> None:
    """In a sticky, world-writable directory another user can bind the path first. The
    exporter names that listener's uid and pid (SO_PEERCRED) instead of calling it an
    exporter, and says what to do."""
    os.chmod(tmpdir_short, 0o755)  # the other user must reach the directory below
    d = tmpdir_short / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)  # root's, sticky, world-writable: allowed for the exporter (root)
    path = d / "t.sock"
    squatter = subprocess.Popen(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            "import socket, sys, time\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
            f"s.bind({str(path)!r}); s.listen(); print('ready', flush=True); time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout is not None and squatter.stdout.readline() == "ready\n"
        out = subprocess.run(
            [sys.executable, "-m", "trainmon_exporter", "--socket", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        squatter.kill()
        squatter.communicate()  # reaps it and closes its pipe
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert (
        f"{path} is held by a process of uid 65534, pid {squatter.pid}, not a trainmon "
        "exporter of this user (uid 0)"
    ) in out.stderr
    assert "TRAINMON_EXPORTER_UID=0 refuse it" in out.stderr
    assert "another exporter" not in out.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the file to another user")
def test_a_lock_file_of_another_user_is_named_as_not_ours(tmpdir_short: Path) -> None:
    d = tmpdir_short / "shared"
    d.mkdir()
    os.chmod(d, 0o1777)
    lock = d / "t.sock.lock"
    lock.write_text("")
    os.chown(lock, 65534, 65534)  # planted first by another user
    out = subprocess.run(
        [sys.executable, "-m", "trainmon_exporter", "--socket", str(d / "t.sock")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert (
        f"{lock} belongs to uid 65534, not to this user (uid 0): not a trainmon exporter's lock"
    ) in out.stderr
    assert lock.exists() and not (d / "t.sock").exists()
