"""Thresholds have one owner, ``AnalyticsSettings``: every copy of a default elsewhere agrees.

Alerts read the exporter's verdicts, so changing a setting moves them. What is left are
numbers written into prose for people: alert descriptions, dashboard text, HELP strings and
the docs. Each is pinned here to the default it copies, so changing a default fails until its
copies say the same.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainmon_exporter.settings import SEVERITIES, AnalyticsSettings

from .conftest import ROOT
from .helpers.checkout import tracked

DEFAULTS = AnalyticsSettings()
ALERTS = ROOT / "deploy" / "prometheus" / "trainmon.alerts.yml"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
GOLDEN = ROOT / "tests" / "golden" / "session.exposition.txt"
NUMBER = r"([0-9][0-9.]*(?:e-?[0-9]+)?)"


def alert_rules() -> dict[str, dict[str, Any]]:
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    return {str(r["alert"]): r for r in rules}


def numbers(pattern: str, text: str, where: str) -> list[float]:
    """The numbers ``pattern``'s groups capture in ``text`` (which must contain it)."""
    found = re.search(pattern, text)
    assert found, f"{where} no longer says {pattern!r}: update the pin in this test"
    return [float(g) for g in found.groups()]


# (alert, pattern in its description, the defaults its numbers copy, in order)
ALERT_COPIES = [
    (
        "TrainmonTrainingHung",
        rf"longer than {NUMBER}x its usual step time plus the grace",
        [DEFAULTS.hang_factor],
    ),
    (
        "TrainmonRunHung",
        rf"longer than {NUMBER}x their usual step time plus the grace",
        [DEFAULTS.hang_factor],
    ),
    ("TrainmonLossSpike", rf"z-score of {NUMBER} or more", [DEFAULTS.spike_z["major"]]),
    (
        "TrainmonGradientExplosion",
        rf"gradient norm above {NUMBER} or {NUMBER}x its rolling mean",
        [DEFAULTS.grad_explosion_norm, DEFAULTS.grad_explosion_ratio],
    ),
    (
        "TrainmonLossPlateau",
        rf"changed by less than {NUMBER} % over its trend window",
        [100 * DEFAULTS.plateau_tolerance],
    ),
    (
        "TrainmonMonitoringOverBudget",
        rf"more than {NUMBER} % of its wall time",
        [100 * DEFAULTS.monitoring_budget_ratio],
    ),
    (
        "TrainmonUpdateRatioOutOfRange",
        rf"outside \[{NUMBER}, {NUMBER}\]",
        [DEFAULTS.update_ratio_low, DEFAULTS.update_ratio_high],
    ),
    (
        "TrainmonGradientGainDrift",
        rf"more than {NUMBER}x off its baseline",
        [DEFAULTS.gain_drift_factor],
    ),
    (
        "TrainmonInputBound",
        rf"more than {NUMBER} % of its step time",
        [100 * DEFAULTS.input_bound_ratio],
    ),
    (
        "TrainmonOverfitting",
        rf"by more than {NUMBER} %",
        [100 * DEFAULTS.eval_overfit_gap],
    ),
    (
        "TrainmonRepeatedRollbacks",
        rf"than before {NUMBER} times or more within 30 minutes \(threshold {NUMBER};",
        [DEFAULTS.rollback_repeats, DEFAULTS.rollback_repeats],
    ),
]


@pytest.mark.parametrize(("alert", "pattern", "defaults"), ALERT_COPIES)
def test_alert_descriptions_quote_the_defaults(
    alert: str, pattern: str, defaults: list[float]
) -> None:
    description = str(alert_rules()[alert]["annotations"]["description"])
    assert numbers(pattern, description, alert) == pytest.approx(defaults)


def test_alerts_read_the_exporters_verdicts_not_copies_of_its_thresholds() -> None:
    rules = alert_rules()
    assert "trainmon_train_throughput_dropped == 1" in rules["TrainmonThroughputDrop"]["expr"]
    assert "trainmon_train_straggling == 1" in rules["TrainmonStragglerRank"]["expr"]
    assert rules["TrainmonTrainingHung"]["expr"] == "trainmon_train_hung == 1"
    assert rules["TrainmonInputBound"]["expr"] == "trainmon_train_input_bound == 1"
    # Repeated rollbacks: the exporter exports the time of the rollback_repeats-th latest one.
    repeat = "last_over_time(trainmon_train_step_rollbacks_repeat_timestamp_seconds[30m])"
    assert rules["TrainmonRepeatedRollbacks"]["expr"] == f"{repeat} > time() - 1800"
    for name, rule in rules.items():
        ratio = re.search(r"trainmon_train_(throughput|straggler)_ratio\s*[<>]", rule["expr"])
        assert not ratio, f"{name} compares a ratio with a copy of its threshold"
    # The spike alert pages from `major` on: the severities above the mildest.
    spikes = rules["TrainmonLossSpike"]["expr"]
    assert f'severity=~"{"|".join(SEVERITIES[1:])}"' in spikes


def dashboard_text() -> str:
    return "\n".join(p.read_text() for p in tracked("*.json", under=DASHBOARDS))


def test_dashboard_text_quotes_the_defaults() -> None:
    text = dashboard_text()
    z = numbers(rf"z = {NUMBER} \(minor\), {NUMBER} \(major\), {NUMBER} \(severe\)", text, "")
    assert z == [DEFAULTS.spike_z[s] for s in SEVERITIES]
    budget = numbers(rf"Budget: {NUMBER} % \(monitoring_budget_ratio\)", text, "dashboards")
    assert budget == pytest.approx([100 * DEFAULTS.monitoring_budget_ratio])
    for p in tracked("*.json", under=DASHBOARDS):
        json.loads(p.read_text())  # what was searched is the committed JSON


def setting_copies(text: str) -> list[tuple[str, float]]:
    """Every ``<setting> (<number>)``, ``<setting> (default <number>)``, ``<number>
    (`<setting>`)`` and ``` `<setting>` (<number> by default)`` / ``(`<setting>`, <number> s by
    default)`` in ``text``."""
    names = "|".join(AnalyticsSettings.model_fields)
    patterns = [
        rf"\b({names})\s+\({NUMBER}\)",
        rf"\b({names})\s+\(default\s+{NUMBER}\)",
        rf"{NUMBER}\s+\(`({names})`\)",
        rf"`({names})`\s+\({NUMBER}[^)]*?\s+by\s+default\)",
        rf"`({names})`,\s+{NUMBER}[^,)]*?\s+by\s+default",
    ]
    out = []
    for i, pattern in enumerate(patterns):
        for m in re.finditer(pattern, text):
            name, value = (m[2], m[1]) if i == 2 else (m[1], m[2])
            out.append((name, float(value)))
    return out


def test_the_setting_copy_finder_sees_each_form() -> None:
    text = (
        "x (0.7) straggler_ratio (1.5) and 0.7 (`throughput_drop_ratio`); ema_decay (default 0.99) "
        "`straggler_ratio`\n(1.5 by default), (`hang_grace_seconds`, 30 s by default)"
    )
    assert setting_copies(text) == [
        ("straggler_ratio", 1.5),
        ("ema_decay", 0.99),
        ("throughput_drop_ratio", 0.7),
        ("straggler_ratio", 1.5),
        ("hang_grace_seconds", 30.0),
    ]


@pytest.mark.parametrize(
    "path",
    [
        GOLDEN,  # the HELP strings, as /metrics shows them (tests/exporter/test_golden.py)
        ROOT / "docs" / "metrics.md",
        ROOT / "docs" / "runbooks.md",
    ],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_settings_quoted_with_a_value_quote_the_default(path: Path) -> None:
    text = path.read_text()
    if path == GOLDEN:
        text = "\n".join(ln for ln in text.splitlines() if ln.startswith("# HELP "))
    for name, value in setting_copies(text):
        assert value == pytest.approx(getattr(DEFAULTS, name)), (path.name, name, value)


def test_the_settings_table_of_detection_md_gives_the_defaults() -> None:
    doc = (ROOT / "docs" / "detection.md").read_text()
    section = doc.split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z_0-9]+)` \| ([^|]+) \|", section, re.M))
    assert set(rows) == set(AnalyticsSettings.model_fields)
    for name, said in rows.items():
        default = getattr(DEFAULTS, name)
        if isinstance(default, dict):
            assert said.strip() == ", ".join(f"{k} {v:g}" for k, v in default.items()), name
        else:
            assert float(said) == pytest.approx(default), name
