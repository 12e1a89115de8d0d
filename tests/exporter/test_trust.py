"""Who may write into which run: socket permissions, SO_PEERCRED ownership, allow-lists.

The attacks are real processes of other uids (the test process is root and each client drops
to its uid after importing the client, before it connects), against a real exporter socket.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from typing import Any

import pytest

import trainmon_client

from ..conftest import InProcessExporter, connect, sample, short_tmpdir, wait_for
from ..helpers.exporter import HELLO, invalid, store_of
from ..helpers.uids import (
    ATTACKER,
    ATTACKER_GID,
    OWNER,
    OWNER_GID,
    TRAINERS,
    User,
    crash,
    needs_root,
    owner_resumes,
    run_as,
    shared_exporter,
    start_victim,
    still_crashed,
)

NONFINITE = "trainmon_train_nonfinite_values_total"


def run_view(ex: InProcessExporter, run: str) -> dict[str, Any] | None:
    return next((r for r in ex.runs()["runs"] if r["run"] == run), None)


# Another uid taking over the crashed run, marking it finished with a fake loss.
TAKEOVER = """
r = init("victim")
r.log(4, loss=0.001, tokens=100)
r.finish()
print(r.dropped, flush=True)
"""

# Another uid sending NaNs into a run as a new rank.
NANS = """
r = init("victim", rank=1, world_size=2)
for i in range(1, 20):
    r.log(i, loss=float("nan"), grad_norm=float("inf"))
r.finish()
"""

# Another uid claiming a rank before the real trainer starts.
SQUAT = """
r = init("future")
r.log(1, loss=9.9)
print("claimed" if r.connected else "refused", flush=True)
input()
"""


@needs_root
def test_the_default_socket_keeps_other_users_out(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """Mode 0660: a uid outside the socket's group cannot even connect, so none of the three
    attacks reaches the exporter; the trainers' group (--socket-group) can."""
    ex = shared_exporter(make_exporter, socket_group=str(TRAINERS))
    st = os.stat(ex.socket)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == TRAINERS
    victim = start_victim(ex, groups=(TRAINERS,))
    try:
        out = run_as(ex.socket, ATTACKER, ATTACKER_GID, SQUAT.replace("input()", ""))
        assert out.strip() == "refused"  # EACCES at connect: the kernel said no
        run_as(ex.socket, ATTACKER, ATTACKER_GID, NANS)
    finally:
        crash(ex, victim)
    run_as(ex.socket, ATTACKER, ATTACKER_GID, TAKEOVER)
    m = ex.metrics()
    assert sample(m, "trainmon_ingest_connections_total") == 1  # the victim's only
    assert run_view(ex, "future") is None
    r = ex.rank("victim", 0)
    assert r is not None and r["status"] == "crashed" and r["values"]["loss"] == 2.0
    assert ex.rank("victim", 1) is None


@needs_root
def test_another_uid_cannot_take_over_a_crashed_run(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """The first attack, with the socket open to everyone (0666): refused as not_owner."""
    ex = shared_exporter(make_exporter, socket_mode="0666")
    crash(ex, start_victim(ex))
    run_as(ex.socket, ATTACKER, ATTACKER_GID, TAKEOVER)
    wait_for(lambda: invalid(ex, "not_owner") >= 1)
    still_crashed(ex)
    assert run_view(ex, "victim")["owner_uid"] == OWNER  # type: ignore[index]
    owner_resumes(ex)  # the owner itself may resume its run (a restart after the crash)


@needs_root
def test_another_uid_cannot_send_nans_into_a_live_run(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """The third attack: NaNs as a new rank of someone's run (and as its rank 0)."""
    ex = shared_exporter(make_exporter, socket_mode="0666")
    victim = start_victim(ex)
    try:
        run_as(ex.socket, ATTACKER, ATTACKER_GID, NANS)
        run_as(ex.socket, ATTACKER, ATTACKER_GID, NANS.replace("rank=1", "rank=0"))
        wait_for(lambda: invalid(ex, "not_owner") >= 2)
        m = ex.metrics()
        for field in ("loss", "grad_norm"):
            assert sample(m, NONFINITE, run="victim", rank="0", field=field) == 0
        assert ex.rank("victim", 1) is None
        r = ex.rank("victim", 0)
        assert r is not None and r["up"] and r["health"] == []
        # Root is not special: it cannot write into another uid's run either.
        root = connect(ex, "victim", rank=2, world_size=3)
        root.log(1, loss=float("nan"))
        wait_for(lambda: invalid(ex, "not_owner") >= 3)
        root.finish()
        assert ex.rank("victim", 2) is None
    finally:
        victim.say()
        victim.wait()


@needs_root
def test_a_squatter_is_kept_out_by_the_allow_list(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """The second attack: claiming a run before its trainer. An open socket (0666) cannot tell
    a squatter from the real trainer, so the defence is the socket's group (above) or an
    allow-list: the squatter is refused, and the real trainer then owns the run."""
    ex = shared_exporter(
        make_exporter, socket_mode="0666", allowed_uids=(OWNER,), allowed_gids=(TRAINERS,)
    )
    squatter = User(ex.socket, ATTACKER, ATTACKER_GID, SQUAT)
    wait_for(lambda: invalid(ex, "peer_not_allowed") >= 1)
    run_as(ex.socket, OWNER, OWNER_GID, 'r = init("future"); r.log(1, loss=2.5); r.finish()')
    r = wait_for(lambda: (k := ex.rank("future", 0)) and k["status"] == "finished" and k)
    assert r["values"]["loss"] == 2.5
    assert run_view(ex, "future")["owner_uid"] == OWNER  # type: ignore[index]
    squatter.say()
    squatter.wait()
    # A member of an allowed group (supplementary, from SO_PEERGROUPS) is let in.
    run_as(ex.socket, ATTACKER, ATTACKER_GID, 'r = init("mine"); r.log(1, loss=1.0)', (TRAINERS,))
    wait_for(lambda: ex.rank("mine", 0))
    assert run_view(ex, "mine")["owner_uid"] == ATTACKER  # type: ignore[index]
    assert invalid(ex, "peer_not_allowed") == 1


def _hello(run: str, rank: int = 0) -> dict[str, Any]:
    return HELLO | {"run": run, "rank": rank, "local_rank": rank, "world_size": 4}


def test_a_run_belongs_to_its_uid_as_long_as_its_state_lasts() -> None:
    store = store_of(ttl_s=10)
    a = store.attach(_hello("r"), uid=1000)
    assert not isinstance(a, str) and a.owner_uid == 1000
    assert store.attach(_hello("r", 1), uid=1001) == "not_owner"  # a new rank
    assert store.attach(_hello("r", 1), uid=0) == "not_owner"  # root is not special
    assert store.attach(_hello("r", 0), uid=1001) == "not_owner"  # ahead of duplicate_rank
    assert store.attach(_hello("r", 0), uid=1000) == "duplicate_rank"
    b = store.attach(_hello("r", 1), uid=1000)
    assert not isinstance(b, str)
    a.disconnect(finished=False)
    b.disconnect(finished=True)
    assert store.attach(_hello("r", 0), uid=1001) == "not_owner"  # crashed: still owned
    assert store.attach(_hello("other"), uid=1001) is not None  # other runs are free
    assert store.expire(now_mono=b.disconnected_mono + 10) == 2  # type: ignore[operator]
    c = store.attach(_hello("r", 0), uid=1001)  # state gone: a new run with that id
    assert not isinstance(c, str) and c.owner_uid == 1001 and c.step is None


# A listener of another uid at the trainers' path: counts the packets it is sent.
FOREIGN = """
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(SOCK)
s.listen()
print("listening", flush=True)
s.settimeout(0.2)
got = 0
conns = []
while True:
    try:
        conns.append(s.accept()[0])
    except (TimeoutError, socket.timeout):
        pass
    for c in conns:
        c.setblocking(False)
        try:
            while c.recv(70000):
                got += 1
        except BlockingIOError:
            pass
    if os.path.exists(SOCK + ".stop"):
        break
print(got, flush=True)
"""


@needs_root
@pytest.mark.parametrize("expected_uid", [None, "0"])
def test_a_trainer_can_refuse_a_listener_of_another_uid(
    monkeypatch: pytest.MonkeyPatch, expected_uid: str | None
) -> None:
    """A foreign socket at the path used to receive every step with nothing dropped; with
    TRAINMON_EXPORTER_UID the client sends it nothing and counts the steps as dropped."""
    d = short_tmpdir()
    d.chmod(0o777)  # a shared directory nobody guards (the exporter would refuse it)
    try:
        foreign = User(str(d / "t.sock"), ATTACKER, ATTACKER_GID, FOREIGN)
        assert foreign.proc.stdout is not None
        assert foreign.proc.stdout.readline().strip() == "listening"
        if expected_uid is None:
            monkeypatch.delenv("TRAINMON_EXPORTER_UID", raising=False)
        else:
            monkeypatch.setenv("TRAINMON_EXPORTER_UID", expected_uid)
        run = trainmon_client.init(
            run="r",
            rank=0,
            world_size=1,
            local_rank=0,
            socket_path=str(d / "t.sock"),
            flush_interval=0.0,
        )
        for i in range(5):
            run.log(i, loss=1.0)
        run.finish()
        (d / "t.sock.stop").touch()
        _, out, _ = foreign.wait()
        received = int(out.split()[-1])
        if expected_uid is None:
            # the attack: the steps reached the foreign listener, nothing counted as dropped
            assert received >= 1 and run.dropped["disconnected"] == 0
        else:
            assert received == 0 and run.dropped["disconnected"] == 5
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_malformed_expected_uid_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINMON_EXPORTER_UID", "root")  # not a uid: one warning, fails closed
    run = trainmon_client.init(run="r", socket_path="/nonexistent/t.sock")
    assert run._sender.transport.exporter_uid == -1
    assert run.sanitised_env == ("TRAINMON_EXPORTER_UID",)
