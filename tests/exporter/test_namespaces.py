"""Runs of the same id from two Kubernetes namespaces on one exporter never meet.

Real clients on the exporter's real Unix socket, each told its pod's namespace and name as
the downward API tells it (``POD_NAMESPACE``, ``POD_NAME``), beside one off Kubernetes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest

import trainmon_client
from trainmon_client import _protocol as P
from trainmon_client._env import detect_pod

from ..conftest import InProcessExporter, connect, raw_connect, sample, wait_for
from ..helpers.exporter import HELLO, hello, invalid, pkt, step, store_of


@contextmanager
def in_pod(namespace: str | None, pod: str | None) -> Iterator[None]:
    """The client's environment in a pod; None: no pod (``POD_NAMESPACE`` empty: no file read)."""
    with mock.patch.dict(os.environ, {"POD_NAMESPACE": namespace or ""}):
        os.environ.pop("POD_NAME", None)
        if pod is not None:
            os.environ["POD_NAME"] = pod
        yield


def rank_of(ex: InProcessExporter, namespace: str, run: str) -> dict[str, object] | None:
    for r in ex.runs()["runs"]:
        if (r["namespace"], r["run"]) == (namespace, run) and r["ranks"]:
            return r["ranks"][0]  # type: ignore[no-any-return]
    return None


def test_the_same_run_id_in_two_namespaces_and_off_kubernetes_are_three_runs(
    exporter: InProcessExporter,
) -> None:
    runs: dict[str, trainmon_client.Run] = {}
    for ns, pod, steps in (
        ("team-a", "pretrain-0", 3),
        ("team-b", "pretrain-x7", 5),
        (None, None, 7),
    ):
        with in_pod(ns, pod):
            run = connect(exporter, "r1")  # one uid, one run id, rank 0 each
        assert run.namespace == (ns or "")
        for i in range(1, steps + 1):
            run.log(i, loss=float(steps), tokens=10)
        runs[ns or ""] = run
    for ns, steps in (("team-a", 3), ("team-b", 5), ("", 7)):
        wait_for(
            lambda ns=ns, steps=steps: (r := rank_of(exporter, ns, "r1")) and r["step"] == steps
        )
    m = exporter.metrics()
    for ns, steps in (("team-a", 3), ("team-b", 5)):
        labels = {"namespace": ns, "run": "r1", "rank": "0"}
        assert sample(m, "trainmon_train_loss", **labels) == float(steps)
        assert sample(m, "trainmon_run_up", **labels) == 1.0
        assert sample(m, "trainmon_run_info", namespace=ns, run="r1", world_size="1") == 1.0
    # Off Kubernetes the labels are left out, not empty: the series are what they always were.
    assert sample(m, "trainmon_train_loss", run="r1", rank="0") == 7.0
    assert sample(m, "trainmon_run_info", run="r1", world_size="1") == 1.0
    text = exporter.metrics_text()
    assert 'namespace=""' not in text and 'pod=""' not in text
    info = [dict(k[1]) for k in m if k[0] == "trainmon_rank_info" and dict(k[1]).get("run") == "r1"]
    assert sorted((i.get("namespace", "-"), i.get("pod", "-")) for i in info) == [
        ("-", "-"),  # off Kubernetes: neither label
        ("team-a", "pretrain-0"),
        ("team-b", "pretrain-x7"),
    ]
    assert not sum(v for k, v in m.items() if k[0] == "trainmon_ingest_hellos_refused_total")
    # The status page and trainmon status name the namespace's run as namespace/run.
    page = exporter.client.get("/").text
    assert "team-a/r1" in page and "team-b/r1" in page
    for run in runs.values():
        run.finish()


def test_a_namespaces_run_is_its_own_on_reconnect_and_finish(exporter: InProcessExporter) -> None:
    with in_pod("team-a", "p0"):
        a = connect(exporter, "r1")
    a.log(1, loss=1.0)
    wait_for(lambda: rank_of(exporter, "team-a", "r1"))
    with in_pod("team-b", "p0"):
        b = connect(exporter, "r1")  # the same rank of the same id, while team-a's is live
    b.log(1, loss=2.0)
    wait_for(lambda: rank_of(exporter, "team-b", "r1"))
    a.finish()
    wait_for(lambda: (r := rank_of(exporter, "team-a", "r1")) and r["status"] == "finished")
    b_rank = rank_of(exporter, "team-b", "r1")
    assert b_rank is not None and b_rank["status"] == "running" and b_rank["up"]
    b.finish()


@pytest.mark.parametrize(
    ("namespace", "pod"),
    [
        ("Team_A", None),  # upper case and _: not a Kubernetes name
        ("a" * 64, None),  # longer than a DNS label
        ("-team", None),
        (7, None),  # not a string
        ("team-a", "Pod Name"),
        ("team-a", "p" * 254),
        ("team-a", "pod..0"),
    ],
)
def test_a_namespace_or_pod_that_is_no_kubernetes_name_is_refused(
    exporter: InProcessExporter, namespace: object, pod: object
) -> None:
    fields = {"namespace": namespace} | ({} if pod is None else {"pod": pod})
    conn = raw_connect(exporter.socket)
    try:
        conn.send(pkt(hello(**fields), step(1)))
        wait_for(lambda: invalid(exporter, "bad_hello") == 1)
    finally:
        conn.close()
    assert not exporter.runs()["runs"]


def test_a_null_namespace_is_no_namespace(exporter: InProcessExporter) -> None:
    conn = raw_connect(exporter.socket)
    try:
        conn.send(pkt(hello(run="nulls", namespace=None, pod=None), step(1)))
        wait_for(lambda: rank_of(exporter, "", "nulls"))
    finally:
        conn.close()


def test_the_client_takes_the_namespace_from_the_service_account_file(tmp_path: Path) -> None:
    ns_file = tmp_path / "namespace"
    ns_file.write_text("ml-research\n")
    assert detect_pod({}, [], str(ns_file)) == ("ml-research", "")
    assert detect_pod({"POD_NAMESPACE": "team-a", "POD_NAME": "p-0"}, [], str(ns_file)) == (
        "team-a",
        "p-0",
    )
    assert detect_pod({}, [], str(ns_file.with_name("missing"))) == ("", "")
    assert detect_pod({"POD_NAMESPACE": ""}, [], str(ns_file)) == ("", "")  # opted out
    issues: list[str] = []
    assert detect_pod({"POD_NAMESPACE": "Bad_NS", "POD_NAME": "x y"}, issues, "/none") == ("", "")
    assert issues == ["POD_NAMESPACE", "POD_NAME"]
    ns_file.write_text("NotAName")
    issues = []
    assert detect_pod({}, issues, str(ns_file)) == ("", "")
    assert issues == [str(ns_file)]


def test_the_hello_off_kubernetes_is_the_one_older_exporters_know(
    exporter: InProcessExporter,
) -> None:
    """namespace and pod travel only from a pod, so an older exporter counts nothing unknown."""
    with in_pod(None, None):
        plain = connect(exporter, "plain")
    with in_pod("team-a", "p-0"):
        podded = connect(exporter, "podded")
    for run, expected in ((plain, set()), (podded, {"namespace", "pod"})):
        records = [r for packet in run._sender.hello_packets() for r in P.iter_records(packet)]
        fields = [P.decode_hello(payload) for rtype, payload in records if rtype == P.HELLO]
        assert len(fields) == 1
        assert set(fields[0]) == set(P.HELLO_FIELDS) - {"namespace", "pod"} | expected
        run.finish()
    assert fields[0]["namespace"] == "team-a" and fields[0]["pod"] == "p-0"


def test_a_trainer_without_a_namespace_meets_one_claiming_the_default(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """The DaemonSet gives ranks without a namespace its own, as Prometheus labels them: a
    client claiming that namespace is the same run there, not a second one shadowing it."""
    ex = make_exporter(default_namespace="trainmon-system")
    with in_pod(None, None):
        plain = connect(ex, "r1")
    plain.log(1, loss=1.0)
    wait_for(lambda: rank_of(ex, "trainmon-system", "r1"))
    assert sample(ex.metrics(), "trainmon_run_up", namespace="trainmon-system", run="r1", rank="0")
    conn = raw_connect(ex.socket)
    try:  # the same rank of the same run, claimed through the namespace: already connected
        conn.send(pkt(hello(run="r1", namespace="trainmon-system"), step(1)))
        wait_for(
            lambda: sample(
                ex.metrics(),
                "trainmon_ingest_hellos_refused_total",
                reason="duplicate_rank",
                uid=str(os.getuid()),
            )
        )
    finally:
        conn.close()
    plain.finish()


class Claims:
    """Owner claims as the Slurm prolog leaves them: run id -> uid."""

    def __init__(self, claims: dict[str, int]) -> None:
        self.claims = claims

    def lookup(self, run: str) -> int | None:
        return self.claims.get(run)


def test_an_owner_claim_holds_for_its_run_id_in_every_namespace() -> None:
    store = store_of()
    store.claims = Claims({"slurm-7": 1000})  # type: ignore[assignment]
    job = HELLO | {"run": "slurm-7"}
    # slurmd in a pod passes its service account's namespace on to the job's processes
    assert store.attach(job | {"namespace": "slurm"}, uid=2000) == "not_owner"
    assert store.attach(job | {"namespace": "other"}, uid=2000) == "not_owner"
    assert store.attach(job, uid=2000) == "not_owner"
    owned = store.attach(job | {"namespace": "slurm"}, uid=1000)
    assert not isinstance(owned, str) and owned.run_key == "slurm/slurm-7"
    assert store.owner_of("slurm/slurm-7") == 1000
