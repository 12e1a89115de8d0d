"""Teams told apart by the kernel: a trainer's pod from its cgroup, its namespace from the node.

The cgroup layouts are those the kubelet's two drivers make under cgroup v1 and v2 with
containerd, CRI-O and Docker, as ``/proc/PID/cgroup`` shows them with and without a cgroup
namespace; the pod list is a directory laid out as the kubelet's pod log directory. The last
test runs it all for real: pods' cgroups made on this machine, a real exporter in a cgroup
namespace of its own, and two teams' trainers of one uid moved into two pods.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from trainmon_exporter.local import LocalExporter
from trainmon_exporter.peers import (
    Peer,
    PeerResolver,
    PodDirectory,
    PodRef,
    _peer_pidfd,
    pod_of_cgroup,
    root_ups,
)

from ..conftest import parse_metrics, sample, short_tmpdir, wait_for
from ..helpers.kubelet import Node, Pod, node_or_skip
from ..helpers.uids import OWNER, OWNER_GID, User, needs_root

UID = "1b2c3d4e-5f60-4718-93a4-b5c6d7e8f901"
UID_ = UID.replace("-", "_")
OTHER = "0f1e2d3c-4b5a-4968-8776-a5b4c3d2e1f0"
CID = "3f" * 32


@pytest.mark.parametrize(
    ("text", "container"),
    [
        # cgroup v2, systemd driver, containerd, Burstable
        (
            "0::/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
            CID,
        ),
        # cgroup v2, systemd driver, CRI-O, Guaranteed (no QoS level)
        (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope\n", CID),
        # cgroup v2, cgroupfs driver, containerd
        (f"0::/kubepods/besteffort/pod{UID}/{CID}\n", CID),
        # cgroup v1 (hybrid), cgroupfs driver, Docker through cri-dockerd: one line per hierarchy
        (
            f"12:pids:/kubepods/burstable/pod{UID}/{CID}\n"
            f"11:memory:/kubepods/burstable/pod{UID}/{CID}\n"
            f"1:name=systemd:/kubepods/burstable/pod{UID}/{CID}\n0::/\n",
            CID,
        ),
        # cgroup v1, systemd driver, CRI-O; the unified line of a hybrid host names no pod
        (
            "4:cpu,cpuacct:/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope\n"
            "1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/"
            f"kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope\n0::/init.scope\n",
            CID,
        ),
        # systemd driver, Docker
        (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/docker-{CID}.scope\n", CID),
        # kind: the kubelet's cgroups under /kubelet.slice
        (
            "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
            f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
            CID,
        ),
        # the pod's own cgroup, and CRI-O's conmon beside the container: no container ID
        (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice\n", ""),
        (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{CID}.scope\n", ""),
    ],
)
def test_the_pod_of_every_layout_the_kubelet_makes(text: str, container: str) -> None:
    assert pod_of_cgroup(text) == PodRef(UID, container)


def test_seen_from_a_cgroup_namespace_only_cgroups_below_the_readers_ancestors_count() -> None:
    """The exporter's container sits 4 levels down (host PID 1 reads ``/../../../../init.scope``);
    a trainer of another QoS class shares 1 of them, a user's own cgroups none."""
    ups = root_ups("0::/../../../../init.scope\n")
    assert ups == {"0": 4}
    trainer = (
        "0::/../../../kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n"
    )
    assert pod_of_cgroup(trainer, ups) == PodRef(UID, CID)
    same_qos = f"0::/../../kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n"
    assert pod_of_cgroup(same_qos, ups) == PodRef(UID, CID)
    delegated = (
        "0::/../../../../user.slice/user-1000.slice/user@1000.service/kubepods.slice/"
        f"kubepods-pod{UID_}.slice/x.scope\n"
    )
    assert pod_of_cgroup(delegated, ups) is None
    assert pod_of_cgroup(trainer) is None  # without knowing where the reader sits: no pod
    assert pod_of_cgroup(trainer, {"4": 9}) is None  # another hierarchy's depth


@pytest.mark.parametrize(
    "text",
    [
        "0::/\n",
        "0::/system.slice/sshd.service\n",
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        # a user's delegated subtree, named as the kubelet names pods
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/kubepods.slice/"
        f"kubepods-pod{UID_}.slice/x.scope\n",
        # a cgroup named like a pod outside the kubelet's root
        f"0::/pod{UID}/{CID}\n",
        # two hierarchies that disagree
        f"12:pids:/kubepods/burstable/pod{UID}/{CID}\n11:memory:/kubepods/burstable/pod{OTHER}/x\n",
        # not a UUID, upper case
        f"0::/kubepods/burstable/pod{UID.upper()}/{CID}\n",
        "",
        "garbage without colons",
    ],
)
def test_what_names_no_pod(text: str) -> None:
    assert pod_of_cgroup(text) is None


def test_a_container_that_makes_cgroups_below_its_own_stays_in_its_own_pod() -> None:
    nested = (
        "0::/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope/"
        f"kubepods.slice/kubepods-pod{OTHER.replace('-', '_')}.slice/x.scope\n"
    )
    assert pod_of_cgroup(nested) == PodRef(UID, CID)


@pytest.fixture
def pod_logs(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "pods"
    d.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    yield d


def test_the_pod_directory_names_each_pod_and_lists_again_when_it_changes(
    pod_logs: Path,
) -> None:
    (pod_logs / f"team-a_train-0_{UID}").mkdir()
    for junk in (
        "no-underscores",
        f"Team_A_{OTHER}",  # four parts
        f"team-b_train-1_{OTHER}_x",
        "team-b_train-1_not-a-uid",
        f"UPPER_train-1_{OTHER}",
        f"team-b_Bad.Pod_{OTHER}",
    ):
        (pod_logs / junk).mkdir()
    pods = PodDirectory(pod_logs)
    assert pods.lookup(UID) == ("team-a", "train-0")
    assert pods.lookup(OTHER) is None
    (pod_logs / f"team-b_train-1_{OTHER}").mkdir()  # a pod started since
    os.utime(pod_logs, ns=(0, 10**18))  # whatever the file system's clock granularity
    assert pods.lookup(OTHER) == ("team-b", "train-1")
    shutil.rmtree(pod_logs / f"team-a_train-0_{UID}")
    assert pods.lookup(UID) == ("team-a", "train-0")  # known pods are not listed again


def test_a_pod_directory_others_may_write_is_not_read(
    pod_logs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (pod_logs / f"team-a_train-0_{UID}").mkdir()
    os.chmod(pod_logs, 0o777)
    with caplog.at_level(logging.WARNING):
        assert PodDirectory(pod_logs).lookup(UID) is None
    assert "pod directory cannot be read" in caplog.text and "0777" in caplog.text
    link = pod_logs.parent / "link"
    os.chmod(pod_logs, 0o755)
    link.symlink_to(pod_logs)
    assert PodDirectory(link).lookup(UID) is None
    assert PodDirectory(pod_logs.parent / "missing").lookup(UID) is None


def _fake_proc(tmp_path: Path, pid: int, text: str) -> Path:
    proc = tmp_path / "proc"
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(text)
    (proc / "1").mkdir()
    (proc / "1" / "cgroup").write_text("0::/init.scope\n")
    return proc


def test_the_resolver_names_the_pod_and_says_when_it_cannot(tmp_path: Path, pod_logs: Path) -> None:
    (pod_logs / f"team-a_train-0_{UID}").mkdir()
    text = f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n"
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        pid = os.getpid()
        resolver = PeerResolver(PodDirectory(pod_logs), _fake_proc(tmp_path, pid, text))
        assert resolver.resolve(a, pid) == Peer("pod", "team-a", "train-0", UID, CID)
        assert resolver.resolve(a, None).identity == "unverifiable"
        assert resolver.resolve(a, 999_999_999).identity == "unverifiable"  # no /proc entry
        (tmp_path / "proc" / str(pid) / "cgroup").write_text("0::/user.slice\n")
        assert resolver.resolve(a, pid).identity == "host"
        other = f"0::/kubepods/pod{OTHER}/{CID}\n"
        (tmp_path / "proc" / str(pid) / "cgroup").write_text(other)
        assert resolver.resolve(a, pid) == Peer("unknown_pod", pod_uid=OTHER, container=CID)


def test_a_peer_gone_before_its_cgroup_was_read_is_not_believed(
    tmp_path: Path, pod_logs: Path
) -> None:
    """Its PID may name another process by then: the pidfd of the process that connected
    says it is gone, whatever ``/proc/PID`` now holds."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    path = str(short_tmpdir() / "s")
    listener.bind(path)
    listener.listen()
    code = f"import socket\nsocket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).connect({path!r})"
    child = subprocess.Popen([sys.executable, "-c", code])
    conn, _ = listener.accept()
    with listener, conn:
        if _peer_pidfd(conn) == -1:
            pytest.skip("the kernel has no SO_PEERPIDFD (Linux 6.5)")
        child.wait()  # exited and reaped: its PID is free for another process
        (pod_logs / f"team-a_train-0_{UID}").mkdir()
        text = f"0::/kubepods/pod{UID}/{CID}\n"  # what a process that took the PID shows
        resolver = PeerResolver(PodDirectory(pod_logs), _fake_proc(tmp_path, child.pid, text))
        assert resolver.resolve(conn, child.pid).identity == "unverifiable"
    shutil.rmtree(Path(path).parent)


# --------------------------------------------------------------------------- for real

TEAM = """
os.environ["POD_NAMESPACE"] = NAMESPACE  # "": none (and no service-account file read)
print("ready", flush=True)
input()
runs = [init(name) for name in RUNS]
for r in runs:
    for i in range(1, 4):
        r.log(i, loss=LOSS, grad_norm=LOSS, tokens=100)
print("logged", flush=True)
input()
for r in runs:
    r.finish()
"""


def _team(node: Node, sock: str, pod: Pod, runs: list[str], loss: str, namespace: str = "") -> User:
    """A trainer of uid OWNER, moved into ``pod``'s container before it connects, logging
    steps 1 to 3 of each of ``runs``."""
    code = f"NAMESPACE = {namespace!r}\nRUNS = {runs!r}\nLOSS = {loss}\n" + TEAM
    user = User(sock, OWNER, OWNER_GID, code)
    assert user.proc.stdout is not None and user.proc.stdout.readline().strip() == "ready"
    node.place(user.proc.pid, pod)
    user.say()
    assert user.proc.stdout.readline().strip() == "logged"
    return user


def _metrics(ex: LocalExporter) -> dict[Any, float]:
    return parse_metrics(ex.get("/metrics").decode())


@needs_root
def test_two_teams_sharing_a_uid_each_keep_their_own_quota_and_runs() -> None:
    """Two pods of one uid in two namespaces, their cgroups made here (systemd driver and
    cgroup v2 for one, cgroupfs and a v1 hierarchy where this machine has one for the other),
    the node's pod list a directory laid out as the kubelet's, the exporter in a cgroup
    namespace of its own as a DaemonSet's container is: each team holds its own quota of
    ranks, each its own run ``shared``; a pod claiming the other's namespace is refused and
    counted under its own, and cannot write into the other team's run."""
    node = node_or_skip()
    d = short_tmpdir()
    os.chmod(d, 0o755)
    ex = LocalExporter(
        "--socket-mode",
        "0666",
        "--kubelet-pod-logs-dir",
        str(node.pod_logs),
        "--max-ranks",
        "12",
        "--max-ranks-per-uid",
        "3",
        socket_path=d / "t.sock",
        launcher=node.launcher(),
        capture_output=True,
        quiet=False,
    )
    users: list[User] = []
    try:
        team_a = node.pod("team-a", "train-a-0", driver="systemd")
        team_b = node.pod("team-b", "train-b-0", driver="cgroupfs")
        ex.start()
        sock = ex.socket
        for ns, pod, loss in (("team-a", team_a, "1.0"), ("team-b", team_b, "2.0")):
            users.append(_team(node, sock, pod, ["shared"], loss))
            step = {"namespace": ns, "run": "shared", "rank": "0"}
            wait_for(lambda step=step: sample(_metrics(ex), "trainmon_train_step", **step) == 3)
        users.append(_team(node, sock, team_a, ["a1", "a2", "a3"], "1.0"))
        users.append(_team(node, sock, team_b, ["b1", "b2"], "2.0"))
        # A pod of team-b that says it is team-a's, with NaN losses for team-a's run.
        users.append(_team(node, sock, team_b, ["shared"], "float('nan')", "team-a"))
        refused = "trainmon_ingest_hellos_refused_total"
        uid = str(OWNER)
        m = wait_for(
            lambda: (
                (m := _metrics(ex))
                and sample(m, refused, reason="namespace_mismatch", namespace="team-b", uid=uid)
                and sample(m, "trainmon_train_step", namespace="team-b", run="b2", rank="0") == 3
                and m
            ),
            timeout=20,
        )
        for ns, loss in (("team-a", 1.0), ("team-b", 2.0)):
            labels = {"namespace": ns, "run": "shared", "rank": "0"}
            assert sample(m, "trainmon_train_step", **labels) == 3
            assert sample(m, "trainmon_train_loss", **labels) == loss
            assert sample(m, "trainmon_train_nonfinite_values_total", field="loss", **labels) == 0
        # Each team's own quota of 3 ranks: one of team-a's four is refused (whichever
        # connected last), team-b's three fit.
        assert sample(m, refused, reason="uid_rank_quota", namespace="team-a", uid=uid) >= 1
        assert sample(m, refused, reason="uid_rank_quota", namespace="team-b", uid=uid) is None
        steps = {
            (dict(k[1])["namespace"], dict(k[1])["run"])
            for k in m
            if k[0] == "trainmon_train_step" and dict(k[1]).get("namespace")
        }
        team_a = {r for ns, r in steps if ns == "team-a"}
        assert len(team_a) == 3 and "shared" in team_a
        assert {r for ns, r in steps if ns == "team-b"} == {"shared", "b1", "b2"}
        holders = [dict(k[1]) for k in m if k[0] == "trainmon_exporter_tenant_ranks"]
        assert sorted(h["namespace"] for h in holders) == ["team-a", "team-b"]  # no uid
        for ns in ("team-a", "team-b"):
            assert sample(m, "trainmon_exporter_tenant_ranks", namespace=ns) == 3
        # The pod's name is the node's; every connection was identified by its pod.
        pods = {
            (dict(k[1])["namespace"], dict(k[1])["run"]): dict(k[1]).get("pod")
            for k in m
            if k[0] == "trainmon_rank_info"
        }
        assert pods == {(ns, r): f"train-{ns[-1]}-0" for ns, r in steps}
        identities = "trainmon_ingest_peer_identities_total"
        assert sample(m, identities, identity="pod") >= 8
        for other in ("host", "unknown_pod", "unverifiable"):
            assert sample(m, identities, identity=other) == 0
    finally:
        for user in users:
            user.say()
            user.wait()
        out = ex.stop() if ex.proc is not None else ""
        node.close()
        shutil.rmtree(d, ignore_errors=True)
    assert "claims namespace team-a, its pod train-b-0 is in namespace team-b" in out
