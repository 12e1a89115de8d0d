"""Counts the docs quote are the counts of the shipped rule files."""

from __future__ import annotations

import re

import yaml

from tests.conftest import ROOT
from tests.helpers.checkout import tracked

PROM = ROOT / "deploy" / "prometheus"


def rule_counts() -> dict[str, tuple[int, int]]:
    """``{group: (alerts, recording rules)}`` of every shipped rule file."""
    counts = {}
    for f in tracked("*.yml", under=PROM):
        spec = yaml.safe_load(f.read_text()) or {}
        for group in spec.get("groups", []):
            rules = group["rules"]
            counts[group["name"]] = (
                sum("alert" in r for r in rules),
                sum("record" in r for r in rules),
            )
    return counts


def test_alerting_md_gives_the_alert_count() -> None:
    doc = (ROOT / "docs" / "alerting.md").read_text()
    said = re.search(r"`deploy/prometheus/trainmon\.alerts\.yml`: (\d+) alerts;", doc)
    assert said, "docs/alerting.md no longer says how many alerts there are"
    spec = yaml.safe_load((PROM / "trainmon.alerts.yml").read_text())
    alerts = [r["alert"] for g in spec["groups"] for r in g["rules"] if "alert" in r]
    assert "Watchdog" not in alerts  # its own file: a stack with a Watchdog leaves it out
    assert int(said[1]) == len(alerts)
    watchdog = yaml.safe_load((PROM / "trainmon.watchdog.alerts.yml").read_text())
    assert [r["alert"] for g in watchdog["groups"] for r in g["rules"]] == ["Watchdog"]


def test_performance_md_rule_table_matches_the_rule_files() -> None:
    doc = (ROOT / "docs" / "performance.md").read_text()
    rows = dict(re.findall(r"^\| `(trainmon\.[a-z]+)` \| (\d+) \|", doc, re.M))
    assert rows, "docs/performance.md has no rule-group table"
    counts = rule_counts()
    for group, n in rows.items():
        assert group in counts, group
        assert int(n) == sum(counts[group]), (group, n, counts[group])
