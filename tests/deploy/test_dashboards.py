"""Grafana dashboards: generated from code, schema-valid, PromQL that parses, real names."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..conftest import ROOT, require_tool
from ..helpers.promql import fleet_key_problems, known_names, used_names

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
        p.name: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))
    }


def queries(dash: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [a["expr"] for a in dash["annotations"]["list"]]
    return out


def test_committed_json_is_what_the_generator_builds() -> None:
    rendered = generator().render()
    assert set(rendered) == {p.name for p in (GRAFANA / "dashboards").glob("*.json")}
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
