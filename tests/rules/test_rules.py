"""Prometheus config and rules are tested like code: promtool checks, promtool unit tests,
metric names against the exporter's metric catalog, and runbook anchors."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ..conftest import ROOT, require_tool
from ..helpers.checkout import tracked
from ..helpers.promql import PROMETHEUS_FILES, fleet_key_problems, known_names, used_names

PROM = ROOT / "deploy" / "prometheus"
RULE_FILES = [
    PROM / "trainmon.rules.yml",
    PROM / "trainmon.alerts.yml",
    PROM / "trainmon.watchdog.alerts.yml",
    PROM / "trainmon.dcgm.rules.yml",
]


def promtool() -> str:
    return require_tool("promtool", "prometheus")


def run(*args: str, cwd: Path = ROOT) -> str:
    out = subprocess.run(args, capture_output=True, text=True, cwd=cwd, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_promtool_checks_config_and_rules() -> None:
    run(promtool(), "check", "config", str(PROM / "prometheus.yml"))
    # The per-cluster and agent configs (their file_sd files do not exist here: a warning).
    for name in ("prometheus-cluster.yml", "prometheus-agent.yml"):
        run(promtool(), "check", "config", str(PROM / name))
    run(promtool(), "check", "rules", *map(str, RULE_FILES))


@pytest.mark.parametrize(
    "name", [p.name for p in tracked("*_test.yml", under=ROOT / "tests" / "rules")]
)
def test_promtool_unit_tests(name: str) -> None:
    out = run(promtool(), "test", "rules", name, cwd=ROOT / "tests" / "rules")
    assert "SUCCESS" in out


def alerts() -> list[dict[str, object]]:
    return [
        rule
        for name in ("trainmon.alerts.yml", "trainmon.watchdog.alerts.yml")
        for rule in yaml.safe_load((PROM / name).read_text())["groups"][0]["rules"]
    ]


def test_every_alert_has_the_conventional_shape_and_a_unit_test() -> None:
    tested = (ROOT / "tests" / "rules" / "alerts_test.yml").read_text()
    for rule in alerts():
        name = str(rule["alert"])
        assert re.fullmatch(r"(Trainmon[A-Z][A-Za-z]+|Watchdog)", name), name
        assert "for" in rule, name
        labels = rule["labels"]
        assert isinstance(labels, dict) and labels["severity"] in ("critical", "warning", "info")
        ann = rule["annotations"]
        assert isinstance(ann, dict)
        assert str(ann["summary"]).endswith("."), name
        assert "{{" in str(ann["description"]) or name == "Watchdog", name
        assert str(ann["runbook_url"]).endswith(f"#alert-name-{name.lower()}")
        assert f"alertname: {name}" in tested, f"{name} has no promtool unit test"


def test_every_runbook_anchor_exists() -> None:
    doc = (ROOT / "docs" / "runbooks.md").read_text()
    for rule in alerts():
        anchor = str(rule["annotations"]["runbook_url"]).split("#", 1)[1]  # type: ignore[index]
        assert f'<a id="{anchor}"></a>' in doc, f"docs/runbooks.md lacks {anchor}"


def test_rule_metric_names_exist_in_the_catalog() -> None:
    """Every series a Prometheus file or a rule unit test names is one the exporter can expose
    (trainmon_exporter.catalog), a recording rule, or a dcgm-exporter series."""
    known = known_names()
    files = [*PROMETHEUS_FILES, *tracked("*_test.yml", under=ROOT / "tests" / "rules")]
    missing = {
        str(path.relative_to(ROOT)): sorted(unknown)
        for path in files
        if (unknown := used_names(path.read_text()) - known)
    }
    assert not missing, f"names the exporter does not expose: {missing}"
    assert used_names("rate(trainmon_train_stepz_total[5m])") - known  # the check can fail


def test_the_throttle_alert_matches_exactly_the_slowdown_reasons() -> None:
    """TrainmonGpuThrottled and the API's slowdown_reasons use one list (sw_power_cap is out)."""
    from trainmon_exporter.nvml import CLOCK_EVENT_REASONS, SLOWDOWN_REASONS

    (rule,) = [r for r in alerts() if r["alert"] == "TrainmonGpuThrottled"]
    regexes = re.findall(r'reason=~"([^"]*)"', str(rule["expr"]))
    assert regexes == ["|".join(SLOWDOWN_REASONS)]
    assert "sw_power_cap" not in SLOWDOWN_REASONS
    assert list(SLOWDOWN_REASONS) == [r for r in CLOCK_EVENT_REASONS if r in SLOWDOWN_REASONS]


def test_rules_key_runs_by_cluster_namespace_and_run() -> None:
    """Never by run alone: joins, groupings and the queries in annotations carry the fleet labels.

    Grouping by ``rank`` or ``uuid`` alone stays allowed (a GPU's UUID is unique fleet-wide).
    """
    found = {}
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                texts = [rule["expr"], *rule.get("annotations", {}).values()]
                problems = [p for t in texts for p in fleet_key_problems(str(t))]
                if problems:
                    found[rule.get("alert") or rule.get("record")] = problems
    assert not found, found
    assert fleet_key_problems("sum by (run) (x)") == ["by (run)"]  # the check can fail
    assert fleet_key_problems("x{run=%q,rank=%q}") == ["{run=%q,rank=%q}"]


def dcgm_test_with(tmp_path: Path, rules: dict[str, object], tests: slice) -> str:
    """promtool's output for ``tests`` of tests/rules/dcgm_test.yml run against ``rules``."""
    (tmp_path / "changed.rules.yml").write_text(yaml.safe_dump(rules))
    doc = yaml.safe_load((ROOT / "tests" / "rules" / "dcgm_test.yml").read_text())
    assert doc["rule_files"] == ["../../deploy/prometheus/trainmon.dcgm.rules.yml"]
    doc["rule_files"] = ["changed.rules.yml"]
    doc["tests"] = doc["tests"][tests]
    (tmp_path / "dcgm_test.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    out = subprocess.run(
        [promtool(), "test", "rules", "dcgm_test.yml"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=False,
    )
    assert out.returncode != 0, out.stdout
    return out.stdout + out.stderr


def test_the_dcgm_turnover_test_fails_a_join_that_keeps_finished_ranks(tmp_path: Path) -> None:
    """tests/rules/dcgm_test.yml can fail: with the ranks' record built from every exported
    rank (finished ones stay until the series TTL), a GPU with a finished and a live rank is
    a shared one, and its turnover case no longer finds the live rank."""
    rules = yaml.safe_load((PROM / "trainmon.dcgm.rules.yml").read_text())
    ranks = next(
        r for r in rules["groups"][0]["rules"] if r["record"] == "rank:trainmon_rank_info:uuid"
    )
    assert "trainmon_run_up" in ranks["expr"], "the record no longer keeps only live ranks"
    ranks["expr"] = (
        "max by (cluster, namespace, run, rank, UUID) "
        '(label_replace(trainmon_rank_info{uuid!=""}, "UUID", "$1", "uuid", "(.+)"))'
    )
    out = dcgm_test_with(tmp_path, rules, slice(1, 2))
    assert 'run="a.new"' in out and "time: 6m" in out, out


def test_the_dcgm_shared_gpu_test_fails_the_join_of_every_live_rank(tmp_path: Path) -> None:
    """tests/rules/dcgm_test.yml's shared-GPU case can fail: with one join record per live
    rank (as before the record degraded per GPU), two live ranks on one GPU make the documented
    join many-to-many, and Prometheus fails the whole query."""
    every_rank = (
        "max by (cluster, namespace, run, rank, UUID) (label_replace("
        'trainmon_rank_info{uuid!=""} and on (cluster, namespace, job, instance, run, rank) '
        '(trainmon_run_up == 1), "UUID", "$1", "uuid", "(.+)"))'
    )
    rules = {
        "groups": [
            {
                "name": "trainmon.dcgm",
                "rules": [
                    {"record": "rank:trainmon_rank_info:uuid", "expr": every_rank},
                    {
                        "record": "uuid:trainmon_rank_info:count",
                        "expr": "count by (cluster, UUID) (rank:trainmon_rank_info:uuid)",
                    },
                    {"record": "rank:trainmon_rank_info:dcgm_uuid", "expr": every_rank},
                ],
            }
        ]
    }
    out = dcgm_test_with(tmp_path, rules, slice(2, 3))
    assert "many-to-many" in out, out
