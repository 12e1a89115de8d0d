"""The default socket path: one rule, the same on the client's and the exporter's side.

Root (or a node where ``/run/trainmon`` exists) uses ``/run/trainmon/trainmon.sock``; a normal
user with a runtime directory uses ``$XDG_RUNTIME_DIR/trainmon/trainmon.sock``, which the
exporter can create, so an exporter and a trainer of the same user meet with no setting.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
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
    system = tmp_path / "run-trainmon" / "trainmon.sock"
    monkeypatch.setattr(client_env, "DEFAULT_SOCKET", str(system))
    user_env = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    # No node-wide directory: root keeps the system path, a user gets the runtime dir.
    assert client_env.default_socket(user_env, euid=0) == str(system)
    assert client_env.default_socket(user_env, euid=1000) == "/run/user/1000/trainmon/trainmon.sock"
    assert client_env.default_socket({}, euid=1000) == str(system)
    assert client_env.default_socket({"XDG_RUNTIME_DIR": "relative"}, euid=1000) == str(system)
    # Where the node-wide directory exists (a service's), everyone meets there.
    system.parent.mkdir()
    assert client_env.default_socket(user_env, euid=1000) == str(system)


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


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run both sides as another user")
@pytest.mark.skipif(
    Path(client_env.DEFAULT_SOCKET).parent.exists(),
    reason="this node has a node-wide /run/trainmon, which every user's default points at",
)
def test_a_normal_user_starts_both_sides_with_no_socket_setting() -> None:
    top, runtime = nobody_home()
    env = child_env(XDG_RUNTIME_DIR=str(runtime), HOME=str(runtime))
    env.pop("TRAINMON_SOCKET", None)
    try:
        meet_as_nobody(env, [], runtime / "trainmon" / "trainmon.sock")
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run both sides as another user")
def test_the_readme_socket_path_works_for_a_normal_user() -> None:
    """The path the README gives for the examples, as a user with no runtime directory."""
    readme = (ROOT / "README.md").read_text()
    exporter_paths = set(re.findall(r"trainmon-exporter --socket (\S+?)`", readme))
    trainer_paths = set(re.findall(r"^TRAINMON_SOCKET=(\S+) ", readme, re.M))
    assert len(exporter_paths) == 1 and trainer_paths == exporter_paths, (
        exporter_paths,
        trainer_paths,
    )
    (documented,) = exporter_paths
    top, home = nobody_home()
    env = child_env(HOME=str(home))
    env.pop("XDG_RUNTIME_DIR", None)
    # The shell expands the README's "~" to the user's home.
    path = subprocess.run(
        ["bash", "-c", f"printf %s {documented}"], env=env, capture_output=True, text=True
    ).stdout
    env["TRAINMON_SOCKET"] = path
    try:
        meet_as_nobody(env, ["--socket", path], Path(path))
    finally:
        shutil.rmtree(top, ignore_errors=True)
