"""alertmanager.yml is valid for Alertmanager 0.25 and routes every alert where it should."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from ..conftest import ROOT, require_tool

CONFIG = ROOT / "alertmanager" / "alertmanager.yml"
ALERTS = [
    ROOT / "deploy" / "prometheus" / "trainmon.alerts.yml",
    ROOT / "deploy" / "prometheus" / "trainmon.watchdog.alerts.yml",
]
EXPECTED = {"critical": "pagerduty", "warning": "slack", "info": "slack"}


def amtool() -> str:
    return require_tool("amtool", "prometheus-alertmanager")


def route(*labels: str) -> str:
    out = subprocess.run(
        [amtool(), "config", "routes", "test", f"--config.file={CONFIG}", *labels],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


def test_amtool_accepts_the_config() -> None:
    out = subprocess.run(
        [amtool(), "check-config", str(CONFIG)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(("severity", "receiver"), sorted(EXPECTED.items()))
def test_each_severity_reaches_its_receiver(severity: str, receiver: str) -> None:
    assert route("alertname=TrainmonSomething", f"severity={severity}", "run=r") == receiver


def test_every_shipped_alert_is_routed_by_its_severity() -> None:
    rules = [r for f in ALERTS for r in yaml.safe_load(f.read_text())["groups"][0]["rules"]]
    assert "Watchdog" in {r["alert"] for r in rules}
    for rule in rules:
        sev = rule["labels"]["severity"]
        expected = "watchdog" if rule["alert"] == "Watchdog" else EXPECTED[sev]
        assert route(f"alertname={rule['alert']}", f"severity={sev}", "run=r") == expected


def test_no_secret_is_inline() -> None:
    cfg = yaml.safe_load(CONFIG.read_text())
    for receiver in cfg["receivers"]:
        for pd in receiver.get("pagerduty_configs", []):
            assert "routing_key" not in pd and "service_key" not in pd
            assert pd["routing_key_file"].startswith("/etc/alertmanager/secrets/")
        for slack in receiver.get("slack_configs", []):
            assert "api_url" not in slack and slack["api_url_file"].startswith("/etc/")


def render(alert_labels: dict[str, str], annotations: dict[str, str], tmp_path: Path) -> str:
    """The shipped notification text for one firing alert (``amtool template render``)."""
    data = {
        "receiver": "slack",
        "status": "firing",
        "alerts": [
            {
                "status": "firing",
                "labels": alert_labels,
                "annotations": annotations,
                "startsAt": "2026-11-22T00:00:00Z",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "",
                "fingerprint": "1",
            }
        ],
        "groupLabels": {"alertname": alert_labels["alertname"]},
        "commonLabels": alert_labels,
        "commonAnnotations": annotations,
        "externalURL": "http://alertmanager",
    }
    path = tmp_path / "data.json"
    path.write_text(json.dumps(data))
    out = subprocess.run(
        [
            amtool(),
            "template",
            "render",
            f"--template.glob={ROOT / 'alertmanager' / 'templates' / 'trainmon.tmpl'}",
            '--template.text={{ template "trainmon.title" . }}\n{{ template "trainmon.text" . }}',
            f"--template.data={path}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_gpu_alerts_name_the_gpu_its_ranks_and_link_the_gpu_dashboard(tmp_path: Path) -> None:
    text = render(
        {
            "alertname": "TrainmonGpuXidError",
            "gpu": "3",
            "uuid": "GPU-abc",
            "xid": "79",
            "instance": "node7:9478",
            "job": "trainmon",
            "severity": "critical",
        },
        {
            "summary": "A GPU reported an XID critical error.",
            "description": "GPU 3 (GPU-abc) on node7:9478 reported XID 79.",
            "ranks": "llm rank 3, llm rank 11",
            "runbook_url": "https://trainmon.invalid/docs/runbooks.md#alert-name-trainmongpuxiderror",
        },
        tmp_path,
    )
    assert "gpu: 3 (GPU-abc) · ranks on it: llm rank 3, llm rank 11 · host: node7:9478" in text
    assert "/d/trainmon-gpu/?var-instance=node7%3A9478&var-gpu=3" in text
    assert "run: -" not in text  # not the rank layout


def test_rank_alerts_keep_the_run_layout(tmp_path: Path) -> None:
    text = render(
        {
            "alertname": "TrainmonLowMfu",
            "run": "llm",
            "rank": "2",
            "instance": "node7:9478",
            "job": "trainmon",
            "severity": "warning",
        },
        {
            "summary": "Model FLOPs utilisation has been low for 30 minutes.",
            "description": "Run llm rank 2 runs at 9% MFU (threshold 15 %).",
            "step": "1200",
            "runbook_url": "https://trainmon.invalid/docs/runbooks.md#alert-name-trainmonlowmfu",
        },
        tmp_path,
    )
    assert "run: llm · rank: 2 · step: 1200 · host: node7:9478" in text
    assert "/d/trainmon-training/?var-run=llm&var-rank=2" in text
    assert "[FIRING:1] TrainmonLowMfu - run llm" in text


def test_fleet_alerts_link_the_run_of_their_cluster(tmp_path: Path) -> None:
    """An alert from a fleet (cluster and namespace labels) opens that cluster's run."""
    text = render(
        {
            "alertname": "TrainmonRunNonFinite",
            "cluster": "east",
            "namespace": "team-a",
            "run": "slurm-7",
            "severity": "critical",
        },
        {
            "summary": "A run logged NaN or infinite loss or gradient norm values on some of "
            "its ranks.",
            "description": "Run slurm-7 logged non-finite loss or gradient norm values on 1 "
            "ranks in the last 5 minutes (ranks with any so far: 3 on n2:9478).",
            "runbook_url": "https://trainmon.invalid/docs/runbooks.md#alert-name-trainmonrunnonfinite",
        },
        tmp_path,
    )
    assert "/d/trainmon-training/?var-run=slurm-7&var-cluster=east&var-namespace=team-a" in text
    assert "ranks with any so far: 3 on n2:9478" in text
