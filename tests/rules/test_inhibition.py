"""Inhibition in the shipped alertmanager.yml, run by a real Alertmanager.

Alertmanager counts a label that is missing on both sides of an inhibit rule as equal: a rule
``equal: [run]`` lets an alert without ``run`` (a GPU XID, an exporter down) silence every
warning without ``run`` and the Watchdog. One set of alerts covering every scope is posted to
Alertmanager's API at once, as Prometheus would send them, and the test asserts which of them
reach the loopback receiver (PagerDuty, Slack and a dead-man switch webhook on the Watchdog
receiver) and which Alertmanager holds as inhibited.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from ..conftest import short_tmpdir, wait_for
from ..integration.stack import Processes, Receiver, am_alerts, require_binaries

pytestmark = pytest.mark.slow

# case -> (labels, delivered?). The summary annotation carries the case name, and the shipped
# templates put the summary into every Slack and PagerDuty payload.
CASES: dict[str, tuple[dict[str, str], bool]] = {
    # Alerts without a run: none of them may silence anything outside its own scope.
    "xid": (
        {
            "alertname": "TrainmonGpuXidError",
            "severity": "critical",
            "instance": "n1:9478",
            "job": "trainmon",
            "gpu": "0",
            "uuid": "GPU-a",
            "xid": "79",
        },
        True,
    ),
    "exporter-down": (
        {
            "alertname": "TrainmonExporterDown",
            "severity": "critical",
            "instance": "n2:9478",
            "job": "trainmon",
        },
        True,
    ),
    "exporter-absent": (
        {"alertname": "TrainmonExporterAbsent", "severity": "critical", "job": "trainmon"},
        True,
    ),
    "watchdog": ({"alertname": "Watchdog", "severity": "info"}, True),
    # Warnings of runs and GPUs that have no critical alert of their own: delivered.
    "quiet-run-spike": (
        {
            "alertname": "TrainmonLossSpike",
            "severity": "warning",
            "run": "quiet",
            "rank": "0",
            "instance": "n3:9478",
            "job": "trainmon",
        },
        True,
    ),
    "quiet-run-plateau": (
        {
            "alertname": "TrainmonLossPlateau",
            "severity": "info",
            "run": "quiet",
            "rank": "0",
            "instance": "n3:9478",
            "job": "trainmon",
        },
        True,
    ),
    "other-gpu-pressure": (
        {
            "alertname": "TrainmonGpuMemoryPressure",
            "severity": "warning",
            "instance": "n3:9478",
            "job": "trainmon",
            "gpu": "1",
            "uuid": "GPU-c",
        },
        True,
    ),
    # Run scope: a critical alert of run "bad" silences that run's warnings only.
    "bad-run-nan": (
        {
            "alertname": "TrainmonNonFiniteValues",
            "severity": "critical",
            "run": "bad",
            "rank": "0",
            "instance": "n4:9478",
            "job": "trainmon",
        },
        True,
    ),
    "bad-run-spike": (
        {
            "alertname": "TrainmonLossSpike",
            "severity": "warning",
            "run": "bad",
            "rank": "1",
            "instance": "n4:9478",
            "job": "trainmon",
        },
        False,
    ),
    # The same run name in another cluster is another run.
    "east-shared-hung": (
        {
            "alertname": "TrainmonTrainingHung",
            "severity": "critical",
            "cluster": "east",
            "namespace": "a",
            "run": "shared",
            "rank": "0",
            "instance": "e1:9478",
            "job": "trainmon",
        },
        True,
    ),
    "west-shared-drop": (
        {
            "alertname": "TrainmonThroughputDrop",
            "severity": "warning",
            "cluster": "west",
            "namespace": "a",
            "run": "shared",
            "rank": "0",
            "instance": "w1:9478",
            "job": "trainmon",
        },
        True,
    ),
    # A run-level page stands for its ranks' pages.
    "fleet-run-nan": (
        {
            "alertname": "TrainmonRunNonFinite",
            "severity": "critical",
            "cluster": "east",
            "namespace": "a",
            "run": "fleet",
        },
        True,
    ),
    "fleet-rank-nan": (
        {
            "alertname": "TrainmonNonFiniteValues",
            "severity": "critical",
            "cluster": "east",
            "namespace": "a",
            "run": "fleet",
            "rank": "3",
            "instance": "e2:9478",
            "job": "trainmon",
        },
        False,
    ),
    # GPU scope: the XID'd GPU's warnings are silenced, not the node's other GPUs'.
    "xid-gpu-throttled": (
        {
            "alertname": "TrainmonGpuThrottled",
            "severity": "warning",
            "instance": "n1:9478",
            "job": "trainmon",
            "gpu": "0",
            "uuid": "GPU-a",
        },
        False,
    ),
    "xid-node-other-gpu": (
        {
            "alertname": "TrainmonGpuThrottled",
            "severity": "warning",
            "instance": "n1:9478",
            "job": "trainmon",
            "gpu": "1",
            "uuid": "GPU-b",
        },
        True,
    ),
    # Node scope: the down exporter's node is silenced, other nodes are not.
    "down-node-collector": (
        {
            "alertname": "TrainmonCollectorFailing",
            "severity": "warning",
            "instance": "n2:9478",
            "job": "trainmon",
            "collector": "gpu",
        },
        False,
    ),
    "up-node-collector": (
        {
            "alertname": "TrainmonCollectorFailing",
            "severity": "warning",
            "instance": "n3:9478",
            "job": "trainmon",
            "collector": "gpu",
        },
        True,
    ),
}


@pytest.fixture(scope="module")
def delivered() -> Iterator[tuple[Receiver, str]]:
    require_binaries("prometheus-alertmanager", package="prometheus-alertmanager")
    tmp = short_tmpdir()
    receiver = Receiver()
    procs = Processes(tmp)
    # The Watchdog receiver ships empty (a dead-man switch is site-specific): point it at the
    # receiver, as a user plugs in theirs. Routes, inhibitions and templates stay as shipped.
    url = procs.alertmanager(receiver)
    cfg_path = tmp / "alertmanager.yml"
    cfg = yaml.safe_load(cfg_path.read_text())
    for rec in cfg["receivers"]:
        if rec["name"] == "watchdog":
            rec["webhook_configs"] = [{"url": f"http://127.0.0.1:{receiver.port}/watchdog"}]
    cfg_path.write_text(yaml.safe_dump(cfg))
    try:
        wait_for(lambda: _ready(url), timeout=30, interval=0.2)
        _reload(url)
        now = datetime.now(UTC)
        alerts = [
            {
                "labels": labels,
                "annotations": {"summary": f"case {name}.", "runbook_url": "x"},
                "startsAt": now.isoformat(),
                "endsAt": (now + timedelta(minutes=10)).isoformat(),
            }
            for name, (labels, _) in CASES.items()
        ]
        req = urllib.request.Request(
            f"{url}/api/v2/alerts",
            data=json.dumps(alerts).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(req, timeout=5).close()
        yield receiver, url
    except BaseException:
        procs.dump()
        raise
    finally:
        procs.stop()
        receiver.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _reload(url: str) -> None:
    """Load the config rewritten after start (the Watchdog webhook)."""
    req = urllib.request.Request(f"{url}/-/reload", method="POST")
    urllib.request.urlopen(req, timeout=10).close()
    with urllib.request.urlopen(f"{url}/api/v2/status", timeout=5) as r:
        assert "/watchdog" in json.loads(r.read())["config"]["original"]


def _arrived(receiver: Receiver, case: str) -> list[str]:
    """Receiver paths (/pagerduty, /slack, /watchdog) that got a firing payload of ``case``."""
    out = []
    for path, body, _ in list(receiver.posts):
        text = json.dumps(body)
        firing = '"status": "firing"' in text or "FIRING" in text
        watchdog_case = path == "/watchdog" and case == "watchdog"
        if firing and (f"case {case}." in text or watchdog_case):
            out.append(path)
    return out


def test_inhibited_alerts_are_exactly_those_in_the_scope_of_a_critical_one(
    delivered: tuple[Receiver, str],
) -> None:
    receiver, url = delivered
    expected = {c for c, (_, ok) in CASES.items() if ok}
    wait_for(lambda: all(_arrived(receiver, c) for c in expected), timeout=30, interval=0.2)

    # What Alertmanager itself holds as inhibited, and by which alert.
    held = {
        a["annotations"]["summary"].removeprefix("case ").removesuffix("."): a["status"]
        for a in am_alerts(url)
    }
    assert set(held) == set(CASES)
    inhibited = {c for c, st in held.items() if st["inhibitedBy"]}
    assert inhibited == {c for c, (_, ok) in CASES.items() if not ok}, held

    # Every group flushed together after the same 1 s group wait: by now the inhibited
    # alerts would have been delivered along with the others.
    for case in sorted(set(CASES) - expected):
        assert _arrived(receiver, case) == [], case


@pytest.mark.parametrize(
    ("case", "path"),
    [
        ("xid", "/pagerduty"),
        ("exporter-down", "/pagerduty"),
        ("quiet-run-spike", "/slack"),
        ("other-gpu-pressure", "/slack"),
        ("watchdog", "/watchdog"),
    ],
)
def test_alerts_without_a_run_neither_silence_nor_are_silenced(
    delivered: tuple[Receiver, str], case: str, path: str
) -> None:
    receiver, _ = delivered
    assert path in wait_for(lambda: _arrived(receiver, case), timeout=30, interval=0.2)


def test_every_inhibit_rule_scopes_both_sides() -> None:
    """Static guard: one ``equal`` label of each rule is required non-empty on both sides
    (a label missing on both would count as equal), and no rule can target the Watchdog."""
    cfg = yaml.safe_load((Path(__file__).parents[2] / "alertmanager/alertmanager.yml").read_text())
    for rule in cfg["inhibit_rules"]:
        src, tgt = rule["source_matchers"], rule["target_matchers"]
        required = {m.split("=~")[0] for m in src if m.endswith('=~".+"')}
        required_t = {m.split("=~")[0] for m in tgt if m.endswith('=~".+"')}
        assert required & required_t & set(rule["equal"]), rule
        names_watchdog = any(m.startswith("alertname=") and "Trainmon" in m for m in tgt)
        assert 'alertname!="Watchdog"' in tgt or names_watchdog, rule
