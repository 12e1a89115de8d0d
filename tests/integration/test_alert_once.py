"""An event pages once, for real: trainer -> client -> exporter -> Prometheus -> Alertmanager ->
a PagerDuty and Slack receiver on loopback.

- An exporter stopped (SIGSTOP) for 30 s, then resumed: Prometheus fails its scrapes and marks
  every series stale. Nothing new reaches the receiver afterwards for the NaN that paged (and
  resolved) before it; a fresh NaN after it pages.
- An exporter restarted while a trainer logs: the trainer reconnects with the records it could
  not deliver meanwhile. Those drops are the restart's, and no team is warned about them.

The shipped rules, routes and templates are used as they are, except timing: 1 s scrape and
evaluation, 1 s group waits, and the event alerts' windows and ``for:`` in seconds instead of
minutes, 2 s a minute (``time() - 300`` becomes ``time() - 10``, ``for: 5m`` becomes ``for:
10s``), so that each case takes seconds. With the rules these replaced (``x offset 5m``
becoming ``x offset 10s``), the NaN pages again as the exporter resumes, and the restart's
drops warn the team 10 seconds after they show.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import trainmon_client

from ..conftest import ExporterProcess, free_port, short_tmpdir, wait_for
from .stack import PROM_DIR, Processes, Receiver, query, require_binaries, shipped

pytestmark = pytest.mark.slow

EVENT_ALERTS = (
    "TrainmonNonFiniteValues",
    "TrainmonRunNonFinite",
    "TrainmonTrainerCrashed",
    "TrainmonLossSpike",
    "TrainmonRepeatedRollbacks",
    "TrainmonGradientExplosion",
    "TrainmonMemoryLeak",
    "TrainmonUpdateRatioOutOfRange",
    "TrainmonGradientGainDrift",
    "TrainmonClientDroppingMessages",
    "TrainmonIngestInvalidMessages",
    "TrainmonTrainerRefused",
    "TrainmonAllocatorPressure",
    "TrainmonGpuXidError",
    "TrainmonGpuLost",
)
SCALE = 30
"""A minute of an event alert's window or ``for:`` lasts 2 s here."""
STALL_S = 30.0
QUIET_S = 15.0
"""How long nothing new must arrive: the NaN alert's window (10 s here) or the drop alert's
``for:`` (10 s), with evaluation, group wait and delivery."""


def seconds(m: re.Match[str]) -> str:
    return f"{int(m[1]) * 60 // SCALE}s"


def scaled_alerts(dst: Path) -> Path:
    """The shipped alert rules with the event alerts' windows and ``for:`` in seconds."""
    doc = yaml.safe_load((PROM_DIR / "trainmon.alerts.yml").read_text())
    done = set()
    for rule in doc["groups"][0]["rules"]:
        if rule.get("alert") not in EVENT_ALERTS:
            continue
        expr = re.sub(r"time\(\) - (\d+)", lambda m: f"time() - {int(m[1]) // SCALE}", rule["expr"])
        expr = re.sub(r"\[(\d+)m\]", lambda m: f"[{seconds(m)}]", expr)  # the rules before
        expr = re.sub(r"offset (\d+)m", lambda m: f"offset {seconds(m)}", expr)
        assert expr != rule["expr"], f"{rule['alert']}: no window to scale"
        rule["expr"] = expr
        rule["for"] = re.sub(r"^(\d+)m$", seconds, str(rule["for"]))
        done.add(rule["alert"])
    assert done == set(EVENT_ALERTS)
    path = dst / "trainmon.alerts.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class Stack:
    """Alertmanager and Prometheus scraping one exporter, which can be stalled or restarted."""

    def __init__(self, tmp: Path, receiver: Receiver) -> None:
        self.tmp = tmp
        self.socket = tmp / "t.sock"
        # The hang grace outlasts the stall: the test is about events, not hangs.
        self.exporter = ExporterProcess(
            self.socket, free_port(), "--analytics.hang-grace-seconds", "600"
        ).start()
        self.procs = Processes(tmp)
        am_url = self.procs.alertmanager(receiver)
        prom = shipped("prometheus.yml")
        prom["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        prom["rule_files"] = [str(PROM_DIR / "trainmon.rules.yml"), str(scaled_alerts(tmp))]
        prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [
            am_url.removeprefix("http://")
        ]
        target = f"127.0.0.1:{self.exporter.port}"
        prom["scrape_configs"][0]["static_configs"][0]["targets"] = [target]
        self.prom_url = self.procs.prometheus(prom, "prometheus")

    def up(self) -> bool:
        res = query(self.prom_url, 'up{job="trainmon"}')
        return bool(res) and res[0]["value"][1] == "1"

    def stop(self) -> None:
        self.procs.stop()
        self.exporter.stop()


class Trainer:
    """A rank that logs a finite loss every ``period`` s on its own thread; ``nan()`` makes
    its next step NaN."""

    def __init__(self, socket: Path, run: str, period: float) -> None:
        self.run = trainmon_client.init(
            run=run, rank=0, world_size=1, socket_path=str(socket), flush_interval=0.0
        )
        self.period = period
        self.step = 0
        self._nan = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            loss = math.nan if self._nan.is_set() else 2.0
            self._nan.clear()
            self.run.log(self.step, loss=loss, tokens=1000)
            self.step += 1
            self._stop.wait(self.period)

    def nan(self) -> float:
        self._nan.set()
        return time.time()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.run.finish()


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Stack, Receiver]]:
    require_binaries("prometheus", package="prometheus")
    require_binaries("prometheus-alertmanager", package="prometheus-alertmanager")
    tmp = short_tmpdir()
    receiver = Receiver()
    st = Stack(tmp, receiver)
    try:
        wait_for(st.up, timeout=60, interval=0.5)
        yield st, receiver
    finally:
        st.stop()
        receiver.close()
        shutil.rmtree(tmp, ignore_errors=True)


def posts(receiver: Receiver, run: str) -> list[str]:
    """Every notification about ``run`` so far (PagerDuty and Slack), as JSON text."""
    return [json.dumps(b) for p in ("/pagerduty", "/slack") for b, _ in receiver.find(p, run)]


def pagerduty(receiver: Receiver, run: str, action: str) -> list[tuple[Any, float]]:
    return [h for h in receiver.find("/pagerduty", run) if h[0]["event_action"] == action]


def test_a_stalled_exporter_pages_nothing_again_and_a_new_nan_pages(
    stack: tuple[Stack, Receiver],
) -> None:
    st, receiver = stack
    run = "e2e-once"
    trainer = Trainer(st.socket, run, period=0.5)
    try:
        nan_at = trainer.nan()
        first = wait_for(lambda: pagerduty(receiver, run, "trigger"), timeout=30, interval=0.2)
        assert "TrainmonRunNonFinite" in json.dumps(first[0][0])
        wait_for(lambda: pagerduty(receiver, run, "resolve"), timeout=30, interval=0.2)
        before = posts(receiver, run)
        # The exporter freezes for 30 s: every scrape fails, every series goes stale.
        pid = st.exporter.proc.pid  # type: ignore[union-attr]
        stalled_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(STALL_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(st.up, timeout=30, interval=0.5)
        missed = query(st.prom_url, f'min_over_time(up{{job="trainmon"}}[{int(STALL_S) + 20}s])')
        assert missed and missed[0]["value"][1] == "0", "Prometheus never saw the stall"
        time.sleep(QUIET_S)
        after = posts(receiver, run)
        assert after == before, (
            f"the {time.time() - nan_at:.0f} s old NaN notified again after the stall:\n"
            + "\n".join(after[len(before) :])
        )
        # The stall cost the trainer nothing (its socket buffer held its records), so no
        # alert about drops was due either.
        assert trainer.run.dropped == dict.fromkeys(trainer.run.dropped, 0), trainer.run.dropped
        # A new NaN pages again.
        fresh_at = trainer.nan()
        second = wait_for(lambda: pagerduty(receiver, run, "trigger")[1:], timeout=30, interval=0.2)
        body, arrived = second[0]
        assert "TrainmonRunNonFinite" in json.dumps(body)
        print(
            f"\nNaN paged, resolved; exporter stopped {STALL_S:.0f} s "
            f"({stalled_at - nan_at:.0f} s after the NaN): nothing new in {QUIET_S:.0f} s after "
            f"it resumed; a new NaN paged {arrived - fresh_at:.2f} s after it was logged"
        )
    finally:
        trainer.stop()


def test_an_exporter_restart_warns_no_team_of_the_drops_it_caused(
    stack: tuple[Stack, Receiver],
) -> None:
    st, receiver = stack
    run = "e2e-restart"
    trainer = Trainer(st.socket, run, period=0.1)
    try:
        wait_for(lambda: query(st.prom_url, f'trainmon_train_step{{run="{run}"}}'), timeout=30)
        st.exporter.stop()  # SIGTERM: it closes the trainer's connection, never a crash
        time.sleep(2.0)  # the trainer logs on; no exporter takes its records
        st.exporter.start()  # a new process, on the same socket and port
        dropped = f'sum(trainmon_client_dropped_messages_total{{run="{run}"}})'

        def reported() -> bool:
            res = query(st.prom_url, dropped)
            return bool(res) and float(res[0]["value"][1]) > 0

        wait_for(reported, timeout=60, interval=0.5)  # the new exporter shows the drops
        drops = sum(trainer.run.dropped.values())
        assert drops > 0, trainer.run.dropped
        # The rules before warned the team 10 s (for: 5m) after the drops showed up.
        time.sleep(QUIET_S)
        assert posts(receiver, run) == [], posts(receiver, run)
        print(f"\nexporter restarted: {drops} records dropped meanwhile, no notification")
    finally:
        trainer.stop()
