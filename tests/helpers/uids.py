"""Real processes of other uids against a real exporter socket (the test process is root).

Each client drops to its uid after importing the client, before it connects; tests that use
them skip when not run as root.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ..conftest import InProcessExporter, child_env, wait_for

OWNER, OWNER_GID = 43002, 43002
ATTACKER, ATTACKER_GID = 43001, 43001
TRAINERS = 43100  # the shared group of the socket

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run clients as other uids (setuid)"
)

PRELUDE = """
import os, sys, time
import trainmon_client
from trainmon_client import _protocol as P
os.setgroups({groups!r}); os.setgid({gid}); os.setuid({uid})
SOCK = {sock!r}
def init(run, rank=0, world_size=1):
    return trainmon_client.init(run=run, rank=rank, world_size=world_size, local_rank=rank,
                                socket_path=SOCK, flush_interval=0.0)
"""


class User:
    """A client process running as another uid; reads commands from stdin via ``input()``."""

    def __init__(
        self, sock: str, uid: int, gid: int, code: str, groups: tuple[int, ...] = ()
    ) -> None:
        src = PRELUDE.format(groups=list(groups), gid=gid, uid=uid, sock=sock)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", src + textwrap.dedent(code)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )

    def say(self, line: str = "") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float = 30) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err


def run_as(sock: str, uid: int, gid: int, code: str, groups: tuple[int, ...] = ()) -> str:
    rc, out, err = User(sock, uid, gid, code, groups).wait()
    assert rc == 0, err
    return out


def shared_exporter(make: Callable[..., InProcessExporter], **settings: Any) -> InProcessExporter:
    """An exporter whose socket other uids can reach (directory 0755)."""
    ex = make(**settings)
    os.chmod(Path(ex.socket).parent, 0o755)
    return ex


def logs_three(run: str = "victim", then: str = "os._exit(0)") -> str:
    """A trainer of ``run`` that logs steps 1 to 3 (loss 2.0), prints "logged", and at a line
    on its stdin runs ``then`` (by default it exits without finishing: a crash)."""
    return f"""
r = init({run!r})
for i in range(1, 4):
    r.log(i, loss=2.0, tokens=100)
print("logged", flush=True)
input()
{then}
"""


VICTIM = logs_three()


def start_victim(ex: InProcessExporter, groups: tuple[int, ...] = ()) -> User:
    victim = User(ex.socket, OWNER, OWNER_GID, VICTIM, groups)
    assert victim.proc.stdout is not None
    assert victim.proc.stdout.readline().strip() == "logged"
    wait_for(lambda: (k := ex.rank("victim", 0)) and k["step"] == 3)
    return victim


def crash(ex: InProcessExporter, victim: User) -> None:
    victim.say()  # the victim exits without finishing
    victim.wait()
    wait_for(lambda: ex.rank("victim", 0)["status"] == "crashed")  # type: ignore[index]


def still_crashed(ex: InProcessExporter) -> None:
    """The victim's rank is as it crashed: what :data:`VICTIM` logged, nothing another sent."""
    r = ex.rank("victim", 0)
    assert r is not None and (r["status"], r["step"], r["values"]["loss"]) == ("crashed", 3, 2.0)


def owner_resumes(ex: InProcessExporter) -> None:
    """The victim's owner restarts its trainer: the run resumes at step 4 and finishes."""
    run_as(ex.socket, OWNER, OWNER_GID, 'r = init("victim"); r.log(4, loss=1.9); r.finish()')
    r = wait_for(lambda: (k := ex.rank("victim", 0)) and k["status"] == "finished" and k)
    assert (r["step"], r["values"]["loss"]) == (4, 1.9)
