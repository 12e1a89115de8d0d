"""End to end, for real: trainer -> client -> exporter -> Prometheus -> Alertmanager -> the
Slack and PagerDuty payloads, captured by an HTTP receiver on loopback.

The shipped rules, routes and templates are used as they are. Only a test overlay changes
the timing (1 s scrape and evaluation intervals, short Alertmanager group waits) and points
the receivers at 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import ROOT, ExporterProcess, child_env, free_port, short_tmpdir, wait_for
from .stack import PROM_DIR, Processes, Receiver, am_alerts, query, require_binaries, shipped

pytestmark = pytest.mark.slow
SCENARIO = ROOT / "benchmarks" / "detection" / "scenario.py"


class Stack:
    """Alertmanager and Prometheus with the shipped configs, scraping one exporter."""

    def __init__(self, tmp: Path, exporter: ExporterProcess, receiver: Receiver) -> None:
        self.procs = Processes(tmp)
        self.am_url = self.procs.alertmanager(receiver)
        prom = shipped("prometheus.yml")
        prom["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        prom["rule_files"] = [str(PROM_DIR / f) for f in prom["rule_files"]]
        prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [
            self.am_url.removeprefix("http://")
        ]
        prom["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{exporter.port}"]
        self.prom_url = self.procs.prometheus(prom, "prometheus")

    def stop(self) -> None:
        self.procs.stop()


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[ExporterProcess, Receiver, Stack]]:
    require_binaries("prometheus", package="prometheus")
    require_binaries("prometheus-alertmanager", package="prometheus-alertmanager")
    tmp = short_tmpdir()
    # A 2 s hang grace (default 30 s), so a stalled trainer is hung within seconds.
    exporter = ExporterProcess(
        tmp / "t.sock", free_port(), "--analytics.hang-grace-seconds", "2"
    ).start()
    receiver = Receiver()
    st = Stack(tmp, exporter, receiver)
    try:
        # The pipeline is up once the Watchdog has travelled all the way (no receiver
        # config: it is routed, not delivered) and Prometheus scrapes the exporter.
        def scraped() -> bool:
            res = query(st.prom_url, 'up{job="trainmon"}')
            return bool(res) and res[0]["value"][1] == "1"

        wait_for(scraped, timeout=60, interval=0.5)
        yield exporter, receiver, st
    finally:
        st.stop()
        exporter.stop()
        receiver.close()
        shutil.rmtree(tmp, ignore_errors=True)


def scenario(exporter: ExporterProcess, name: str, run: str, *extra: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(SCENARIO), "--scenario", name, "--run", run, *extra],
        env=child_env(TRAINMON_SOCKET=exporter.socket),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    marks = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert marks, out.stdout + out.stderr
    return marks[0]


def test_nan_pages_pagerduty_once_per_run_naming_the_rank(stack: Any) -> None:
    """The run-level alert pages; it silences the per-rank alert of the same run."""
    exporter, receiver, _ = stack
    mark = scenario(exporter, "nan", "e2e-nan", "--steps", "300", "--at", "150")
    hits = wait_for(lambda: receiver.find("/pagerduty", "e2e-nan"), timeout=60, interval=0.2)
    body, arrived = hits[0]
    assert body["event_action"] == "trigger"
    assert body["routing_key"] == "test-routing-key-0123456789abcdef"
    assert "TrainmonRunNonFinite" in body["payload"]["summary"]
    details = json.dumps(body["payload"]["custom_details"])
    assert "run: e2e-nan" in details
    assert f"ranks with any so far: 0 on 127.0.0.1:{exporter.port}" in details
    assert "runbooks.md#alert-name-trainmonrunnonfinite" in details
    assert "/d/trainmon-training/?var-run=e2e-nan" in details
    assert body["payload"]["severity"] in ("critical", "error")
    print(f"\nNaN at step {mark['step']} -> PagerDuty after {arrived - mark['time']:.2f} s")
    assert arrived - mark["time"] < 30
    # Alertmanager holds the per-rank alert, suppressed by the run-level one; it never paged.
    muted = wait_for(
        lambda: am_alerts(stack[2].am_url, 'alertname="TrainmonNonFiniteValues"', 'run="e2e-nan"'),
        timeout=30,
    )
    assert muted[0]["status"]["state"] == "suppressed" and muted[0]["status"]["inhibitedBy"]
    pages = [json.dumps(b) for b, _ in receiver.find("/pagerduty", "e2e-nan")]
    assert not any("TrainmonNonFiniteValues" in b for b in pages), pages


def test_loss_spike_goes_to_slack(stack: Any) -> None:
    """The 420 steps take less than a second, often less than one scrape interval: then the
    spike counter is first scraped at 1, and only the rule's `unless ... offset` arm fires."""
    exporter, receiver, _ = stack
    mark = scenario(exporter, "spike", "e2e-spike", "--steps", "420", "--at", "400")
    hits = wait_for(lambda: receiver.find("/slack", "e2e-spike"), timeout=60, interval=0.2)
    body, arrived = hits[0]
    text = json.dumps(body)
    assert "TrainmonLossSpike" in text and "rank: 0" in text
    step = re.search(r"step: (\d+)", text)
    assert step and 400 <= int(step.group(1)) <= 420  # the rank's step when the alert fired
    assert "/d/trainmon-training/?var-run=e2e-spike&var-rank=0" in text
    assert body["attachments"][0]["color"] == "danger"
    assert not receiver.find("/pagerduty", "e2e-spike")  # a warning never pages
    print(f"\nloss spike at step {mark['step']} -> Slack after {arrived - mark['time']:.2f} s")
    attachment = body["attachments"][0]
    print(f"--- Slack message ---\n{attachment['title']}\n{attachment['text']}\n---")


def test_killed_trainer_pages_as_a_crash(stack: Any) -> None:
    exporter, receiver, _ = stack
    mark = scenario(exporter, "crash", "e2e-crash", "--steps", "400", "--at", "100")
    hits = wait_for(
        lambda: receiver.find("/pagerduty", "e2e-crash", "TrainmonTrainerCrashed"),
        timeout=60,
        interval=0.2,
    )
    print(f"\nkill -9 at step {mark['step']} -> PagerDuty after {hits[0][1] - mark['time']:.2f} s")


def test_a_stall_pages_and_the_recovery_resolves(stack: Any) -> None:
    """Hung (critical, for: 30s) while the loop sleeps; resolved once it steps again.

    The run has one rank, so the whole run is hung: the run-level alert pages and silences
    the per-rank one.
    """
    exporter, receiver, _ = stack
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCENARIO),
            "--scenario",
            "stall",
            "--run",
            "e2e-stall",
            "--steps",
            "600",
            "--at",
            "300",
            "--stall-seconds",
            "75",
        ],
        env=child_env(TRAINMON_SOCKET=exporter.socket),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:

        def events(action: str) -> list[tuple[Any, float]]:
            return [
                h
                for h in receiver.find("/pagerduty", "e2e-stall")
                if h[0]["event_action"] == action and "TrainmonRunHung" in json.dumps(h[0])
            ]

        triggered = wait_for(lambda: events("trigger"), timeout=120, interval=0.5)
        resolved = wait_for(lambda: events("resolve"), timeout=120, interval=0.5)
        assert resolved[0][0]["dedup_key"] == triggered[0][0]["dedup_key"]
        assert resolved[0][1] > triggered[0][1]
        assert proc.wait(60) == 0
        out = proc.stdout.read() if proc.stdout else ""
        mark = json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))
        print(
            f"\nstall at step {mark['step']}: paged after {triggered[0][1] - mark['time']:.1f} s "
            f"(2 s grace + for: 30s), resolved {resolved[0][1] - mark['time']:.1f} s after it "
            "began (the loop slept 75 s)"
        )
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()
