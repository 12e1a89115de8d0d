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
    user_env = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    runtime = "/run/user/1000/trainmon/trainmon.sock"
    # No node-wide directory: root keeps the system path, a user gets the runtime dir.
    for side in (client_env.default_socket, exporter_default_socket):
        assert side(user_env, euid=0) == str(system)
        assert side(user_env, euid=1000) == runtime
        assert side({}, euid=1000) == str(system)
        assert side({"XDG_RUNTIME_DIR": "relative"}, euid=1000) == str(system)
    # Where the node-wide directory exists and this process may create a socket in it, both
    # sides meet there.
    system.parent.mkdir()
    assert client_env.default_socket(user_env, euid=1000) == str(system)
    assert exporter_default_socket(user_env, euid=1000) == str(system)


def test_the_exporter_default_is_the_clients(monkeypatch: pytest.MonkeyPatch) -> None:
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
        trainer = subprocess.run(
            [sys.executable, "-c", TRAINER],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
            check=False,
        )
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
# there. Both fall back to $XDG_RUNTIME_DIR with one notice, and still meet. Each case runs as
# nobody against a stand-in for /run/trainmon (the module's DEFAULT_SOCKET, set in the child
# before it drops its privileges): the real one is the node's, and other tests read it.

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run both sides as nobody")


def patched(code: str, system: Path) -> str:
    """``code`` with the node-wide socket path moved to ``system`` (before privileges drop)."""
    return f"import trainmon_client._env as _e; _e.DEFAULT_SOCKET = {str(system)!r}\n" + code


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
    proc = subprocess.run(
        [sys.executable, "-c", patched(PROBE, system)],
        capture_output=True,
        text=True,
        env=env,
        cwd=env["HOME"],
        timeout=60,
    )
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
    where = system.parent
    assert lines == [
        f"trainmon: {where} exists but it holds no socket it may connect to (uid {NOBODY}); using "
        f"{fallback} instead (TRAINMON_SOCKET sets another path)",
        f"{where} exists but it may not create a socket there (uid {NOBODY}); using "
        f"{fallback} instead (TRAINMON_SOCKET sets another path)",
    ]
    # A socket there this user may not connect to (mode 0600, root's) changes nothing.
    with listen(system, 0o600):
        assert probe(system, env)[0] == {"client": fallback, "exporter": fallback}


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
        trainer = subprocess.run(
            [sys.executable, "-c", patched(TRAINER, system)],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=60,
        )
        assert trainer.returncode == 0, trainer.stderr
        assert "no exporter" not in trainer.stderr, trainer.stderr
        assert f"using {expected} instead" in trainer.stderr

        def arrived() -> bool:
            import httpx

            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            return sample(parse_metrics(text), "trainmon_train_step", run="mine", rank="0") == 1

        wait_for(arrived, timeout=20)
    finally:
        exporter.terminate()
        out = exporter.communicate(timeout=20)[0]
    assert f"using {expected} instead" in out, out
    assert f"trainers connect to {expected}" in out, out
