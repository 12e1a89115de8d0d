"""The event alerts page once: each case of tests/rules/events_test.yml can fail.

Every case (a failed scrape, a gap, a Prometheus restart, an exporter restart, a pod that
moved, an event before the first scrape) is run on its own against the rules as they were
before event alerts read the time of the event: ``increase(x[W]) > 0 or (x > 0 unless x offset
W)``, kept here verbatim. Each case must fail there (the old rules re-page, or miss the event)
and pass with the shipped rules, so none of them is a test that cannot fail.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ..conftest import ROOT, require_tool

PROM = ROOT / "deploy" / "prometheus"
EVENTS_TEST = ROOT / "tests" / "rules" / "events_test.yml"

OLD_EXPRS = {
    "TrainmonNonFiniteValues": """
increase(trainmon_train_nonfinite_values_total{field=~"loss|grad_norm"}[5m]) > 0
or (trainmon_train_nonfinite_values_total{field=~"loss|grad_norm"} > 0
    unless trainmon_train_nonfinite_values_total offset 5m)""",
    "TrainmonRunNonFinite": """
count by (cluster, namespace, run) (
  sum by (cluster, namespace, run, rank) (
    increase(trainmon_train_nonfinite_values_total{field=~"loss|grad_norm"}[5m]) > 0
    or (trainmon_train_nonfinite_values_total{field=~"loss|grad_norm"} > 0
        unless trainmon_train_nonfinite_values_total offset 5m)
  )
)""",
    "TrainmonTrainerCrashed": """
increase(trainmon_run_crashes_total[5m]) > 0
or (trainmon_run_crashes_total > 0 unless trainmon_run_crashes_total offset 5m)""",
    "TrainmonLossSpike": """
sum without (severity) (
  increase(trainmon_train_loss_spikes_total{severity=~"major|severe"}[10m]) > 0
  or (trainmon_train_loss_spikes_total{severity=~"major|severe"} > 0
      unless trainmon_train_loss_spikes_total offset 10m)
)""",
    "TrainmonRepeatedRollbacks": """
increase(trainmon_train_step_rollbacks_total[30m]) >= 3
or (trainmon_train_step_rollbacks_total >= 3
    unless trainmon_train_step_rollbacks_total offset 30m)""",
    "TrainmonGradientExplosion": """
increase(trainmon_train_grad_explosions_total[10m]) > 0
or (trainmon_train_grad_explosions_total > 0
    unless trainmon_train_grad_explosions_total offset 10m)""",
    "TrainmonMemoryLeak": """
increase(trainmon_train_memory_leaks_total[30m]) > 0
or (trainmon_train_memory_leaks_total > 0
    unless trainmon_train_memory_leaks_total offset 30m)""",
    "TrainmonUpdateRatioOutOfRange": """
increase(trainmon_train_update_ratio_high_total[30m])
  + increase(trainmon_train_update_ratio_low_total[30m]) > 0
or (trainmon_train_update_ratio_high_total + trainmon_train_update_ratio_low_total > 0
    unless trainmon_train_update_ratio_high_total offset 30m)""",
    "TrainmonGradientGainDrift": """
increase(trainmon_train_grad_gain_drifts_total[30m]) > 0
or (trainmon_train_grad_gain_drifts_total > 0
    unless trainmon_train_grad_gain_drifts_total offset 30m)""",
    "TrainmonClientDroppingMessages": """
sum without (reason) (
  increase(trainmon_client_dropped_messages_total[10m]) > 0
  or (trainmon_client_dropped_messages_total > 0
      unless on (cluster, namespace, run, rank) trainmon_client_dropped_messages_total offset 10m)
)""",
    "TrainmonIngestInvalidMessages": """
sum without (reason) (
  increase(trainmon_ingest_messages_invalid_total[10m]) > 0
  or (trainmon_ingest_messages_invalid_total > 0
      unless trainmon_ingest_messages_invalid_total offset 10m)
)""",
    "TrainmonTrainerRefused": """
increase(trainmon_ingest_hellos_refused_total[10m]) > 0
or (trainmon_ingest_hellos_refused_total > 0
    unless trainmon_ingest_hellos_refused_total offset 10m)""",
    "TrainmonAllocatorPressure": """
increase(trainmon_train_allocator_retries_total[10m]) > 0
or increase(trainmon_train_oom_errors_total[10m]) > 0
or (trainmon_train_allocator_retries_total > 0
    unless on (cluster, namespace, run, rank) trainmon_train_allocator_retries_total offset 10m)
or (trainmon_train_oom_errors_total > 0
    unless on (cluster, namespace, run, rank) trainmon_train_oom_errors_total offset 10m)""",
    "TrainmonGpuXidError": """
increase(trainmon_gpu_xid_errors_total[5m]) > 0
or (trainmon_gpu_xid_errors_total > 0 unless trainmon_gpu_xid_errors_total offset 5m)""",
    "TrainmonGpuLost": "increase(trainmon_gpu_lost_total[10m]) > 0",
}
"""The event alerts' expressions before they read event times (each counter's own windows)."""

CASES = {
    "failed scrape": 40,
    "gap": 46,
    "Prometheus restart": 47,
    "exporter restart": 21,
    "pod moved": 22,
    "event before the first scrape": 21,
}
"""Each case of events_test.yml, in order, and the minute from which it checks what the
incident did (the series are back, or the event happened)."""


def shipped_alerts() -> dict[str, object]:
    return yaml.safe_load((PROM / "trainmon.alerts.yml").read_text())  # type: ignore[no-any-return]


def case_files(tmp: Path, rules: str) -> list[Path]:
    """events_test.yml split into one file per case, each testing ``rules``."""
    doc = yaml.safe_load(EVENTS_TEST.read_text())
    assert len(doc["tests"]) == len(CASES)
    files = []
    for i, test in enumerate(doc["tests"]):
        path = tmp / f"case{i + 1}_test.yml"
        path.write_text(
            yaml.safe_dump({**doc, "rule_files": [rules], "tests": [test]}, sort_keys=False)
        )
        files.append(path)
    return files


def promtool_test(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool", "prometheus"), "test", "rules", path.name],
        capture_output=True,
        text=True,
        cwd=path.parent,
        check=False,
    )


def test_every_event_alert_reads_an_event_time() -> None:
    """Each alert the old pattern covered now reads a *_timestamp_seconds series, not a
    counter's increase."""
    rules = {r["alert"]: str(r["expr"]) for r in shipped_alerts()["groups"][0]["rules"]}  # type: ignore[index]
    for name in OLD_EXPRS:
        expr = rules[name]
        assert "timestamp_seconds" in expr and "time()" in expr, name
        assert "increase(" not in expr and " offset " not in expr, name


@pytest.fixture(scope="module")
def old_rules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    doc = shipped_alerts()
    for rule in doc["groups"][0]["rules"]:  # type: ignore[index]
        if rule["alert"] in OLD_EXPRS:
            rule["expr"] = OLD_EXPRS[rule["alert"]].strip()
    path = tmp_path_factory.mktemp("old") / "old.alerts.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("case", range(len(CASES)), ids=list(CASES))
def test_each_case_fails_on_the_rules_it_replaced_and_passes_on_the_shipped_ones(
    case: int, old_rules: Path, tmp_path: Path
) -> None:
    name, incident = list(CASES.items())[case]
    old = case_files(tmp_path, str(old_rules))[case]
    out = promtool_test(old)
    assert out.returncode != 0, f"{name}: passes on the old rules too\n{out.stdout}"
    # It failed on what the incident did, not before it (nor on a typo).
    failed_at = [int(m) for m in re.findall(r"expr: \"ALERTS.*time: (\d+)m,", out.stderr)]
    assert failed_at and max(failed_at) >= incident, out.stderr
    (tmp_path / "new").mkdir()
    new = case_files(tmp_path / "new", str(PROM / "trainmon.alerts.yml"))[case]
    out = promtool_test(new)
    assert out.returncode == 0, f"{name}:\n{out.stdout}{out.stderr}"


def test_ongoing_events_through_a_failed_scrape_fail_on_instant_event_times(
    tmp_path: Path,
) -> None:
    """alerts_test.yml's case of events that go on through a failed scrape can fail: with the
    instant event time (no last_over_time), the NaN alert resolves at the failed scrape (and
    would page again at the next), and the drop alert's for: starts over."""
    doc = shipped_alerts()
    changed = 0
    for rule in doc["groups"][0]["rules"]:  # type: ignore[index]
        expr = re.sub(r"last_over_time\(([^\[]+)\[\d+m\]\)", r"\1", str(rule["expr"]))
        changed += expr != rule["expr"]
        rule["expr"] = expr
    assert changed == len(OLD_EXPRS)
    rules = tmp_path / "instant.alerts.yml"
    rules.write_text(yaml.safe_dump(doc, sort_keys=False))
    tests = yaml.safe_load((ROOT / "tests" / "rules" / "alerts_test.yml").read_text())
    (case,) = [
        t
        for t in tests["tests"]
        if any("stale" in str(s["values"]) for s in t["input_series"])
        and {a["alertname"] for a in t["alert_rule_test"]}
        == {"TrainmonNonFiniteValues", "TrainmonClientDroppingMessages"}
    ]
    path = tmp_path / "ongoing_test.yml"
    path.write_text(
        yaml.safe_dump({**tests, "rule_files": [rules.name], "tests": [case]}, sort_keys=False)
    )
    out = promtool_test(path)
    assert out.returncode != 0, out.stdout
    failed = re.findall(r"alertname: (\w+), time: (\d+m)", out.stderr)
    assert ("TrainmonNonFiniteValues", "5m") in failed, out.stderr
    assert ("TrainmonClientDroppingMessages", "7m") in failed, out.stderr
