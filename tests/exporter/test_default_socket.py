"""The default socket path: one rule, the same on the client's and the exporter's side.

Root (or a user who may use ``/run/trainmon``) uses ``/run/trainmon/trainmon.sock``; a normal
user with a runtime directory uses ``$XDG_RUNTIME_DIR/trainmon/trainmon.sock``, which the
exporter can create, so an exporter and a trainer of the same user meet with no setting.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from subprocess import CompletedProcess

import pytest

import trainmon_client._env as client_env
from tests.conftest import (
    ROOT,
    child_env,
    free_port,
    parse_metrics,
    sample,
    short_tmpdir,
    wait_for,
)
from trainmon_exporter import Settings

from ..helpers.uids import ATTACKER, ATTACKER_GID

pytestmark = pytest.mark.uid  # the rule depends on who runs it

NOBODY = 65534
# Python lives under root's home here, which another user cannot read: each side imports what
# it needs as root, then drops to nobody before it does anything (as a service manager's
# User= would have it from the start).
DROP = "import os; os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
EXPORTER = (
    "import sys\n"
    "import trainmon_exporter.cli as cli\n"
    "import trainmon_exporter.app, trainmon_exporter.httplimits\n"  # cli imports them to serve
    "import uvicorn.config, uvicorn.server, uvicorn.lifespan.on, uvicorn.loops.auto\n"
    "import uvicorn.loops.asyncio, uvicorn.protocols.http.auto, uvicorn.protocols.http.h11_impl\n"
    "import uvicorn.protocols.websockets.auto\n" + DROP + "sys.exit(cli.main(sys.argv[1:]))\n"
)
TRAINER = (
    "import trainmon_client as t\n" + DROP + "r = t.init(run='mine')\n"
    "r.log(1, loss=2.5)\nr.finish()\n"
)


def test_the_rule(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The parts of the rule that do not depend on permissions (those run as another user in
    the tests below)."""
    from trainmon_exporter._defaults import default_socket as exporter_default_socket

    system = tmp_path / "run-trainmon" / "trainmon.sock"
    monkeypatch.setattr(client_env, "DEFAULT_SOCKET", str(system))
    uid = os.geteuid() or 1000  # a normal user's: this process's own, or 1000 for root
    home = tmp_path / "user"
    home.mkdir(mode=0o700)
    os.chown(home, uid, -1)  # its owner; the group is of no account (and may not be uid)
    user_env = {"XDG_RUNTIME_DIR": str(home)}
    runtime = str(home / "trainmon" / "trainmon.sock")
    # No node-wide directory: root keeps the system path, a user gets the runtime dir.
    for side in (client_env.default_socket, exporter_default_socket):
        assert side(user_env, euid=0) == str(system)
        assert side(user_env, euid=uid) == runtime
        assert side({}, euid=uid) == str(system)
        assert side({"XDG_RUNTIME_DIR": "relative"}, euid=uid) == str(system)
    # Where the node-wide directory exists and this process may create a socket in it, both
    # sides meet there.
    system.parent.mkdir()
    assert client_env.default_socket(user_env, euid=uid) == str(system)
    assert exporter_default_socket(user_env, euid=uid) == str(system)


def test_a_runtime_directory_is_used_only_where_it_is_this_users_own(tmp_path: Path) -> None:
    """``$XDG_RUNTIME_DIR`` is inherited and can name a directory someone else can change: the
    socket goes there only where the directory is this user's, as the XDG specification asks
    (owned by it, 0700), and no one else can replace it or the ``trainmon`` directory in it."""
    uid = os.geteuid()
    top = tmp_path / "top"
    top.mkdir(mode=0o755)
    mine = top / "mine"
    mine.mkdir(mode=0o700)
    assert client_env.runtime_dir_problem(str(mine)) is None
    assert client_env.runtime_socket({"XDG_RUNTIME_DIR": str(mine)}) == (
        str(mine / "trainmon" / "trainmon.sock"),
        None,
    )
    # A link to it is resolved: the socket path never goes through a link someone may change.
    (top / "link").symlink_to(mine)
    assert client_env.runtime_socket({"XDG_RUNTIME_DIR": str(top / "link")})[0] == str(
        mine / "trainmon" / "trainmon.sock"
    )
    problems = {
        "another uid": client_env.runtime_dir_problem(str(mine), euid=uid + 1),
        "open mode": (mine.chmod(0o777), client_env.runtime_dir_problem(str(mine)))[1],
        "group write": (mine.chmod(0o770), client_env.runtime_dir_problem(str(mine)))[1],
    }
    mine.chmod(0o700)
    top.chmod(0o777)  # whoever can write the directory above can rename this one away
    problems["open parent"] = client_env.runtime_dir_problem(str(mine))
    top.chmod(0o1777)  # sticky, as /tmp: only its owner may rename it
    assert client_env.runtime_dir_problem(str(mine)) is None
    top.chmod(0o755)
    (mine / "trainmon").mkdir()
    (mine / "trainmon").chmod(0o777)
    problems["open trainmon dir"] = client_env.runtime_dir_problem(str(mine))
    (mine / "trainmon").rmdir()
    (mine / "trainmon").symlink_to(tmp_path)
    problems["trainmon link"] = client_env.runtime_dir_problem(str(mine))
    problems["missing"] = client_env.runtime_dir_problem(str(tmp_path / "nowhere"))
    assert problems == {
        "another uid": f"it belongs to uid {uid}, not to this user (uid {uid + 1})",
        "open mode": "other users may write it (mode 0777; it must be 0700)",
        "group write": "other users may write it (mode 0770; it must be 0700)",
        "open parent": f"{top} above it may be changed by another user (uid {uid}, mode 0777)",
        "open trainmon dir": f"{mine / 'trainmon'} may be changed by another user (uid {uid}, "
        "mode 0777)",
        "trainmon link": f"{mine / 'trainmon'} is not a directory",
        "missing": "it cannot be read (No such file or directory)",
    }
    reason = client_env.runtime_socket({"XDG_RUNTIME_DIR": str(tmp_path / "nowhere")})
    assert reason == (
        None,
        f"XDG_RUNTIME_DIR={tmp_path / 'nowhere'} is not used for the socket: it cannot be read "
        "(No such file or directory)",
    )


def test_the_exporter_default_is_the_clients(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A stand-in for /run/trainmon that does not exist: the host's own may hold a shared
    # exporter this user may connect to but not replace, where the two sides differ by design.
    monkeypatch.setattr(client_env, "DEFAULT_SOCKET", str(tmp_path / "run" / "trainmon.sock"))
    monkeypatch.delenv("TRAINMON_SOCKET", raising=False)
    assert str(Settings().socket) == client_env.default_socket()


def meet_as_nobody(env: dict[str, str], exporter_args: list[str], expected: Path) -> None:
    """Start an exporter and a trainer as nobody with ``env``; the trainer's step arrives and
    the exporter's start-up line names ``expected`` as the socket."""
    port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-c", EXPORTER, *exporter_args, "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=env["HOME"],
    )
    try:
        wait_for(lambda: expected.is_socket() or exporter.poll() is not None, timeout=30)
        assert exporter.poll() is None, exporter.communicate()[0]
        trainer = python(TRAINER, env)
        assert trainer.returncode == 0, trainer.stderr
        assert "no exporter" not in trainer.stderr, trainer.stderr

        def arrived() -> bool:
            import httpx2 as httpx

            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            return sample(parse_metrics(text), "trainmon_train_step", run="mine", rank="0") == 1

        wait_for(arrived, timeout=20)
    finally:
        exporter.terminate()
        out = exporter.communicate(timeout=20)[0]
    # The start-up line tells the user the path trainers must use.
    assert f"trainers connect to {expected}" in out, out


def nobody_home() -> tuple[Path, Path]:
    """A scratch directory readable by all, and in it a home owned by nobody (mode 0700)."""
    top = short_tmpdir()  # pytest's own tmp_path sits under a root-only directory
    top.chmod(0o755)
    home = top / "home"
    home.mkdir(mode=0o700)
    os.chown(home, NOBODY, NOBODY)
    return top, home


def nobody_may_use_run_trainmon() -> bool:
    """Whether nobody may create a socket in this node's ``/run/trainmon`` or connect to one
    there: then that is where both of its defaults point (an unusable one is fallen back from)."""
    system = Path(client_env.DEFAULT_SOCKET)
    try:
        st = system.parent.stat()
    except OSError:
        return False
    if st.st_uid == NOBODY or st.st_mode & 0o003 == 0o003:
        return True
    try:
        return system.is_socket() and bool(system.stat().st_mode & 0o002 and st.st_mode & 0o001)
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run both sides as another user")
@pytest.mark.skipif(
    nobody_may_use_run_trainmon(),
    reason="this node's /run/trainmon is open to every user: both defaults point at it",
)
def test_a_normal_user_starts_both_sides_with_no_socket_setting() -> None:
    top, runtime = nobody_home()
    env = child_env(XDG_RUNTIME_DIR=str(runtime), HOME=str(runtime))
    env.pop("TRAINMON_SOCKET", None)
    try:
        meet_as_nobody(env, [], runtime / "trainmon" / "trainmon.sock")
    finally:
        shutil.rmtree(top, ignore_errors=True)


# ------------------------------------------------------------------ an unusable /run/trainmon
# An admin's shared set-up or a container recipe run once leaves /run/trainmon behind; a normal
# user's exporter with no flags must not fail on it, and that user's trainer must not send
# there. Both fall back to $XDG_RUNTIME_DIR, and still meet; the exporter's start-up line says
# why, and a trainer only where it finds no exporter. Each case runs as
# nobody against a stand-in for /run/trainmon (the module's DEFAULT_SOCKET, set in the child
# before it drops its privileges): the real one is the node's, and other tests read it.

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run both sides as nobody")


def patched(code: str, system: Path) -> str:
    """``code`` with the node-wide socket path moved to ``system`` (before privileges drop)."""
    return f"import trainmon_client._env as _e; _e.DEFAULT_SOCKET = {str(system)!r}\n" + code


def python(code: str, env: dict[str, str], *args: str, cwd: Path = ROOT) -> CompletedProcess[str]:
    """``python -c code args`` with ``env``, run to its end (60 s at most), output captured."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=60,
        check=False,
    )


PROBE = (
    textwrap.dedent(
        """
    import json, logging
    import trainmon_client._env as env
    import trainmon_exporter._defaults as defaults
    logging.basicConfig(format="%(message)s")
    """
    )
    + DROP
    + textwrap.dedent(
        """
    print(json.dumps({"client": env.default_socket(), "exporter": defaults.default_socket()}))
    """
    )
)


@pytest.fixture
def node() -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """(stand-in /run/trainmon/trainmon.sock, nobody's runtime dir, nobody's environment)."""
    top, runtime = nobody_home()
    env = child_env(XDG_RUNTIME_DIR=str(runtime), HOME=str(runtime))
    env.pop("TRAINMON_SOCKET", None)
    yield top / "run-trainmon" / "trainmon.sock", runtime, env
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def admin_node(node: tuple[Path, Path, dict[str, str]]) -> tuple[Path, Path, dict[str, str]]:
    """:func:`node` with the socket's directory made by root, 0755, as an admin or a recipe
    left it."""
    node[0].parent.mkdir(mode=0o755)
    return node


def probe(system: Path, env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    proc = python(patched(PROBE, system), env, cwd=env["HOME"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr.splitlines()


def listen(path: Path, mode: int) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(path))
    s.listen()
    path.chmod(mode)
    return s


@pytest.mark.slow
@needs_root
def test_an_admins_directory_without_a_socket_for_this_user(
    admin_node: tuple[Path, Path, dict[str, str]],
) -> None:
    system, runtime, env = admin_node
    fallback = str(runtime / "trainmon" / "trainmon.sock")
    paths, lines = probe(system, env)
    assert paths == {"client": fallback, "exporter": fallback}
    assert lines == []  # choosing says nothing: each side says what matters when it matters
    # A socket there this user may not connect to (mode 0600, root's) changes nothing.
    with listen(system, 0o600):
        assert probe(system, env)[0] == {"client": fallback, "exporter": fallback}


EXPORTER_SAYS = (
    "import sys, trainmon_exporter.cli as cli\n" + DROP + "sys.exit(cli.main(sys.argv[1:]))\n"
)


@pytest.mark.slow
@needs_root
def test_the_fallback_is_said_only_where_it_matters(
    admin_node: tuple[Path, Path, dict[str, str]],
) -> None:
    """Beside an unusable /run/trainmon, an error stays one line (the notice used to come
    first, before every error, from the settings' default); a trainer that finds its exporter
    says nothing; one that finds none says where it looked and why not /run/trainmon."""
    system, runtime, env = admin_node
    bad = python(patched(EXPORTER_SAYS, system), env, "--listen", "nonsense", cwd=env["HOME"])
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        "trainmon-exporter: error: --listen: expected HOST:PORT (e.g. 127.0.0.1:9478), got "
        "'nonsense'"
    ]
    alone = python(patched(TRAINER, system), env)
    fallback = runtime / "trainmon" / "trainmon.sock"
    assert alone.returncode == 0, alone.stderr
    assert alone.stderr.splitlines() == [
        f"trainmon: no exporter at {fallback} (No such file or directory): not {system.parent}, "
        f"which it holds no socket this user may connect to (uid {NOBODY}); metrics are "
        "dropped and counted until it connects"
    ]


@pytest.mark.slow
@needs_root
def test_a_shared_exporters_socket_is_the_trainers_default(
    admin_node: tuple[Path, Path, dict[str, str]],
) -> None:
    system, runtime, env = admin_node
    with listen(system, 0o666):  # a root exporter open to every user
        paths, lines = probe(system, env)
    assert paths == {"client": str(system), "exporter": str(runtime / "trainmon/trainmon.sock")}
    assert not any("holds no socket" in line for line in lines)


@pytest.mark.slow
@needs_root
def test_a_directory_this_user_may_write_is_used_by_both(
    admin_node: tuple[Path, Path, dict[str, str]],
) -> None:
    system, _runtime, env = admin_node
    os.chown(system.parent, NOBODY, NOBODY)  # a service's RuntimeDirectory for this user
    assert probe(system, env) == ({"client": str(system), "exporter": str(system)}, [])


@pytest.mark.slow
@needs_root
def test_exporter_and_trainer_with_no_flags_meet_beside_an_unusable_run_trainmon(
    admin_node: tuple[Path, Path, dict[str, str]],
) -> None:
    """It used to exit 2 (no permission to create its socket) while the trainer sent there."""
    system, runtime, env = admin_node
    expected = runtime / "trainmon" / "trainmon.sock"
    port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-c", patched(EXPORTER, system), "--listen", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=env["HOME"],
    )
    try:
        wait_for(lambda: expected.is_socket() or exporter.poll() is not None, timeout=30)
        assert exporter.poll() is None, exporter.communicate()[0]
        trainer = python(patched(TRAINER, system), env)
        assert trainer.returncode == 0, trainer.stderr
        assert trainer.stderr == ""  # it found its exporter: nothing to say

        def arrived() -> bool:
            import httpx

            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            return sample(parse_metrics(text), "trainmon_train_step", run="mine", rank="0") == 1

        wait_for(arrived, timeout=20)
    finally:
        exporter.terminate()
        out = exporter.communicate(timeout=20)[0]
    # One start-up line, which says why the socket is not in /run/trainmon and what trainers
    # outside this login must set; no warning before it.
    assert out.splitlines()[0].endswith(
        f"trainers connect to {expected} (not {system.parent}: this user may not create a "
        f"socket there (uid {NOBODY}); trainers without this $XDG_RUNTIME_DIR set "
        f"TRAINMON_SOCKET={expected})"
    ), out


# ------------------------------------------- a runtime directory another user made
# $XDG_RUNTIME_DIR is inherited: a shell after `su`, a job script shared between users, a
# container's environment can name a directory another user made. A trainer must not send
# there (that user's listener would read every step), nor an exporter listen there (that user
# could rename the socket's directory away and put a listener in its place).


@pytest.fixture
def squatted(node: tuple[Path, Path, dict[str, str]]) -> Iterator[tuple[Path, socket.socket]]:
    """A runtime directory of ``uids.ATTACKER`` (mode 0777, as a careless or hostile user
    makes one) with a listener at ``trainmon/trainmon.sock`` that anyone may connect to."""
    top = node[0].parent.parent
    evil = top / "evil-runtime"
    (evil / "trainmon").mkdir(parents=True)
    for d in (evil, evil / "trainmon"):
        d.chmod(0o777)
        os.chown(d, ATTACKER, ATTACKER_GID)
    with listen(evil / "trainmon" / "trainmon.sock", 0o666) as listener:
        listener.setblocking(False)
        yield evil, listener


@pytest.mark.slow
@needs_root
def test_a_trainer_sends_nothing_to_a_runtime_directory_another_user_made(
    node: tuple[Path, Path, dict[str, str]], squatted: tuple[Path, socket.socket]
) -> None:
    system, _, env = node
    evil, listener = squatted
    trainer = python(patched(TRAINER, system), env | {"XDG_RUNTIME_DIR": str(evil)})
    assert trainer.returncode == 0, trainer.stderr
    with pytest.raises(BlockingIOError):  # no connection was ever made to that listener
        listener.accept()
    assert (
        f"trainmon: XDG_RUNTIME_DIR={evil} is not used for the socket: it belongs to uid "
        f"{ATTACKER}, not to this user (uid {NOBODY})"
    ) in trainer.stderr.splitlines(), trainer.stderr


@pytest.mark.slow
@needs_root
def test_an_exporter_does_not_listen_in_a_runtime_directory_another_user_made(
    node: tuple[Path, Path, dict[str, str]], squatted: tuple[Path, socket.socket]
) -> None:
    """Without the ``trainmon`` directory there, the exporter used to make it and listen in it,
    inside a directory the other user can rename it out of."""
    system, _, env = node
    evil, listener = squatted
    listener.close()
    shutil.rmtree(evil / "trainmon")
    out = python(
        patched(EXPORTER_SAYS, system),
        env | {"XDG_RUNTIME_DIR": str(evil)},
        "--listen",
        "127.0.0.1:0",
        cwd=env["HOME"],
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert os.listdir(evil) == []  # nothing made in the other user's directory
    (line,) = out.stderr.splitlines()
    assert f"XDG_RUNTIME_DIR={evil} is not used for the socket: it belongs to uid" in line, line
    assert f"e.g. {evil}" not in line, line  # and no hint to use it


@pytest.mark.slow
@needs_root
def test_permission_denied_is_never_read_as_no_exporter(
    admin_node: tuple[Path, Path, dict[str, str]],
) -> None:
    """A root exporter for its group only (socket 0660, or a directory 0750 as the README's
    Docker recipe makes it): an exporter listens, this user may not use it. The trainer says
    permission denied and what to do, not "no exporter"."""
    system, _, env = admin_node
    env = env | {"TRAINMON_SOCKET": str(system)}

    def trainer_says() -> str:
        out = python(TRAINER, env)
        assert out.returncode == 0, out.stderr
        assert "no exporter" not in out.stderr, out.stderr
        (line,) = out.stderr.splitlines()
        return line

    advice = (
        "; an exporter may be listening there for other users. Ask its admin to add this user "
        "to the socket's group, or start your own exporter and set TRAINMON_SOCKET to its "
        "socket; metrics are dropped and counted until it connects"
    )
    with listen(system, 0o660):
        assert trainer_says() == (
            f"trainmon: permission denied connecting to {system}: this user (uid {NOBODY}) may "
            f"not use {system} (uid 0, group root (0), mode 0660){advice}"
        )
        system.parent.chmod(0o750)
        assert trainer_says() == (
            f"trainmon: permission denied connecting to {system}: this user (uid {NOBODY}) may "
            f"not use {system.parent} (uid 0, group root (0), mode 0750){advice}"
        )
