"""Grafana dashboards: generated from code, schema-valid, PromQL that parses, real names."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..conftest import ROOT, require_tool
from ..helpers.checkout import tracked
from ..helpers.promql import METRIC_NAME, fleet_key_problems, known_names, used_names

GRAFANA = ROOT / "deploy" / "grafana"


def generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "build_dashboards", GRAFANA / "build_dashboards.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        p.name: json.loads(p.read_text()) for p in tracked("*.json", under=GRAFANA / "dashboards")
    }


def queries(dash: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [a["expr"] for a in dash["annotations"]["list"]]
    return out


def test_committed_json_is_what_the_generator_builds() -> None:
    rendered = generator().render()
    assert set(rendered) == {p.name for p in tracked("*.json", under=GRAFANA / "dashboards")}
    for name, text in rendered.items():
        assert (GRAFANA / "dashboards" / name).read_text() == text, (
            f"{name} is stale: run python deploy/grafana/build_dashboards.py"
        )


def subset(small: Any, big: Any, path: str = "") -> list[str]:
    """Paths of ``small`` missing or different in ``big``."""
    if isinstance(small, dict):
        if not isinstance(big, dict):
            return [path]
        return [p for k, v in small.items() for p in subset(v, big.get(k, _MISSING), f"{path}.{k}")]
    if isinstance(small, list):
        if not isinstance(big, list) or len(big) != len(small):
            return [path]
        return [
            p
            for i, (a, b) in enumerate(zip(small, big, strict=True))
            for p in subset(a, b, f"{path}[{i}]")
        ]
    return [] if small == big else [path]


_MISSING = object()


def test_the_generator_names_the_exporters_slowdown_reasons() -> None:
    """build_dashboards.py runs without the exporter, so it keeps a copy of the one list."""
    from trainmon_exporter.nvml import SLOWDOWN_REASONS

    assert generator().SLOWDOWN_REASONS == SLOWDOWN_REASONS
    (panel,) = [
        p
        for p in dashboards()["gpu.json"]["panels"]
        if p["title"] == "Clock-event (throttle) reasons active"
    ]
    assert all(r in panel["description"] for r in SLOWDOWN_REASONS)


def test_dashboards_round_trip_through_the_grafana_sdk() -> None:
    sdk = pytest.importorskip("grafana_foundation_sdk.models.dashboard")
    from grafana_foundation_sdk.cog.encoder import JSONEncoder

    for name, dash in dashboards().items():
        back = json.loads(json.dumps(sdk.Dashboard.from_json(dash), cls=JSONEncoder))
        lost = subset(dash, back)
        assert not lost, f"{name}: keys the schema does not know or changed: {lost[:10]}"


def test_dashboards_use_the_provisioned_datasource_and_variables() -> None:
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    for name, dash in dashboards().items():
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert {"datasource", "cluster", "namespace", "run", "rank"} <= set(variables), name
        # "All" must also match series without the label (a single Prometheus has neither).
        assert variables["cluster"]["allValue"] == variables["namespace"]["allValue"] == ".*"
        assert variables["datasource"]["current"]["value"] == uid
        for p in dash["panels"]:
            if p["type"] != "row":
                assert p["datasource"]["uid"] == "${datasource}", (name, p["title"])
                assert p["fieldConfig"]["defaults"]["unit"], (name, p["title"])


def test_every_query_parses_in_promtool(tmp_path: Path) -> None:
    promtool = require_tool("promtool", "prometheus")
    rules = []
    for dash in dashboards().values():
        for i, q in enumerate(queries(dash)):
            expr = (
                q.replace("$__rate_interval", "1m")
                .replace("$__range", "1h")
                .replace("$run", ".*")
                .replace("$rank", ".*")
                .replace("$instance", ".*")
                .replace("$gpu", ".*")
            )
            rules.append({"record": f"dashboard:query:{len(rules)}_{i}", "expr": expr})
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_metric_name_exists_in_the_catalog() -> None:
    """Panels, annotations and variables name series the exporter can expose
    (trainmon_exporter.catalog), recording rules, or dcgm-exporter series."""
    known = known_names()
    for name, dash in dashboards().items():
        texts = queries(dash) + [str(v["query"]) for v in dash["templating"]["list"]]
        used = set().union(*map(used_names, texts))
        assert len(used) > 10, name
        assert not used - known, f"{name}: {sorted(used - known)}"


def test_queries_key_runs_by_cluster_namespace_and_run() -> None:
    """The same run id in two clusters of one fleet store never shows as one run."""
    found = {
        (name, q): problems
        for name, dash in dashboards().items()
        for q in queries(dash) + [str(v["query"]) for v in dash["templating"]["list"]]
        if (problems := fleet_key_problems(q))
    }
    assert not found, found


def grafana_all(expr: str, dash: dict[str, Any]) -> str:
    """``expr`` as Grafana sends it with every variable on "All": each ``$name`` becomes the
    variable's ``allValue`` (Grafana's Prometheus datasource passes it unescaped)."""
    for v in sorted(dash["templating"]["list"], key=lambda v: -len(v["name"])):
        if v["type"] == "query":
            expr = expr.replace(f"${v['name']}", v["allValue"])
    return expr.replace("$__rate_interval", "1m").replace("$__range", "1h")


def test_every_variable_has_an_all_value_that_matches_absent_labels() -> None:
    for name, dash in dashboards().items():
        for v in dash["templating"]["list"]:
            if v["type"] == "query":
                assert v["includeAll"] and v.get("allValue") == ".*", (name, v["name"])


def firing_alert_label_sets() -> dict[str, list[dict[str, str]]]:
    """``{alert name: [label sets]}`` of every alert the shipped rules fire, as their promtool
    unit tests (tests/rules/alerts_test.yml) expect them: the labels a real firing carries."""
    doc = yaml.safe_load((ROOT / "tests" / "rules" / "alerts_test.yml").read_text())
    out: dict[str, list[dict[str, str]]] = {}
    for test in doc["tests"]:
        for case in test.get("alert_rule_test", []):
            for alert in case.get("exp_alerts") or []:
                labels = {k: str(v) for k, v in alert.get("exp_labels", {}).items()}
                out.setdefault(case["alertname"], []).append(labels)
    return out


def test_every_shipped_alert_shows_in_the_alerts_firing_panel(tmp_path: Path) -> None:
    """Each label set each shipped alert fires with (with or without run, rank, cluster) is
    an ALERTS series; the health dashboard's "Alerts firing" query, its variables on "All",
    returns every one of them (promtool)."""
    promtool = require_tool("promtool", "prometheus")
    shipped = {
        str(r["alert"])
        for f in ("trainmon.alerts.yml", "trainmon.watchdog.alerts.yml")
        for g in yaml.safe_load((ROOT / "deploy" / "prometheus" / f).read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    fired = firing_alert_label_sets()
    assert shipped <= set(fired), f"alerts without a firing unit test: {shipped - set(fired)}"
    dash = dashboards()["health.json"]
    (panel,) = [p for p in dash["panels"] if p["title"] == "Alerts firing"]
    (target,) = panel["targets"]
    expr = grafana_all(target["expr"], dash)
    series = []
    seen = set()
    for name in sorted(shipped):
        for labels in fired[name]:
            full = {"__name__": "ALERTS", "alertname": name, "alertstate": "firing", **labels}
            key = json.dumps(full, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            series.append(full)
    assert any("run" not in s for s in series), "no alert without a run: the premise is gone"

    def text(labels: dict[str, str]) -> str:
        return "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"

    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": text(s), "values": "1x5"} for s in series],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "2m",
                        "exp_samples": [{"labels": text(s), "value": 1} for s in series],
                    }
                ],
            }
        ],
    }
    f = tmp_path / "alerts_panel_test.yml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = subprocess.run(
        [promtool, "test", "rules", str(f)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # Without an all-value Grafana sends the values it found (here: some run ids), and an
    # alert without a run label no longer matches: the check can fail.
    narrowed = target["expr"].replace("$run", "r|other")
    assert grafana_all(narrowed, dash) != expr


CLUSTER_MATCHER = 'cluster=~"$cluster"'


def cluster_key_problems(promql: str) -> list[str]:
    """Places in a dashboard query that could mix clusters: a series selected without the
    ``cluster`` variable's matcher, or a ``by``/``on`` clause without ``cluster`` (``by (le)``
    of a heatmap, which sums what the selectors chose, excepted)."""
    problems = []
    for m in re.finditer(METRIC_NAME.pattern + r"|\bALERTS\b", promql):
        rest = promql[m.end() :]
        selector = re.match(r"\{[^{}]*\}", rest)
        if selector is None or CLUSTER_MATCHER not in selector[0]:
            problems.append(m[0] + (selector[0] if selector else ""))
    for kind, labels in re.findall(r"\b(by|on)\s*\(([^)]*)\)", promql):
        names = {n.strip() for n in labels.split(",")}
        if "cluster" not in names and names != {"le"}:
            problems.append(f"{kind} ({labels})")
    return problems


def variable_queries(dash: dict[str, Any], but: str) -> list[str]:
    """The PromQL of the dashboard's query variables, except the variable ``but``."""
    return [
        v["query"]["query"]
        for v in dash["templating"]["list"]
        if v["type"] == "query" and v["name"] != but
    ]


def test_every_query_is_keyed_by_cluster() -> None:
    """In a fleet store node names, GPU indices and run ids repeat across clusters: every
    panel, annotation and variable query selects by the cluster variable and keeps cluster in
    its groupings and joins."""
    found = {
        (name, q): problems
        for name, dash in dashboards().items()
        for q in queries(dash) + variable_queries(dash, but="cluster")
        if (problems := cluster_key_problems(q))
    }
    assert not found, found
    # the check can fail
    assert cluster_key_problems('x_trainmon{instance=~"$instance"}') == []  # not a name of ours
    assert cluster_key_problems('trainmon_gpu_info{instance=~"$instance"}') != []
    assert cluster_key_problems('sum by (instance) (trainmon_x{cluster=~"$cluster"})') == [
        "by (instance)"
    ]
