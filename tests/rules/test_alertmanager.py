"""alertmanager.yml is valid for Alertmanager 0.25 and routes every alert where it should."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from ..conftest import ROOT, require_tool

CONFIG = ROOT / "alertmanager" / "alertmanager.yml"
ALERTS = ROOT / "deploy" / "prometheus" / "trainmon.alerts.yml"
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
    for rule in yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]:
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
