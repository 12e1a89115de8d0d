"""Generate the Kubernetes objects that repeat files kept elsewhere in the repository.

- ``base/monitoring/prometheusrules.yaml``: one ``PrometheusRule`` (prometheus-operator,
  ``monitoring.coreos.com/v1``) per rule file ``deploy/prometheus/*.rules.yml`` and
  ``*.alerts.yml``, its ``spec.groups`` being the file's ``groups`` unchanged. The object's
  name is the file's name without ``.yml``, dots turned to dashes (``trainmon.alerts.yml`` ->
  ``trainmon-alerts``): :func:`rule_object_name`. The Watchdog's file is left out: the
  Prometheus Operator's stacks (kube-prometheus, kube-prometheus-stack) ship a Watchdog of
  their own, and a second one would reach their dead-man switch as another alert.
- ``base/watchdog/prometheusrule.yaml``: the Watchdog's ``PrometheusRule``, for a Prometheus
  that has none (an overlay adds ``base/watchdog`` then).
- ``base/monitoring/dashboards.yaml``: one ``ConfigMap`` per dashboard
  ``deploy/grafana/dashboards/*.json``, labelled ``grafana_dashboard: "1"`` (the label the
  Grafana sidecar of kube-prometheus-stack and the Grafana operator's docs look for), with
  the JSON text unchanged under ``<name>.json``.
- ``base/exporter/sample-limit.yaml``, ``base/sidecar/sample-limit.yaml`` and
  ``examples/torchrun-job-sidecar/sample-limit.yaml``: strategic-merge patches that put one
  value of :data:`SAMPLE_LIMITS` both into the exporter's ``TRAINMON_SCRAPE_SAMPLE_LIMIT`` and
  into the ``sampleLimit`` of the PodMonitor that scrapes it, so the exporter never sends a
  scrape its Prometheus refuses (it sheds series to stay under its limit instead).
- ``base/exporter/networkpolicy.yaml`` and ``base/sidecar-networkpolicy/networkpolicy.yaml``:
  the NetworkPolicies that let only scrapers (:data:`SCRAPERS`, and pods a platform team labels
  :data:`SCRAPER_LABEL`) reach the exporter's port, one list for the node exporter and the
  sidecars alike.

The rule files, dashboards and :data:`SAMPLE_LIMITS` stay the one source; ``tests/deploy/test_kubernetes.py`` fails
when the committed output differs from what this prints. Run it after changing either:

    python deploy/kubernetes/build.py          # rewrite every generated file
    python deploy/kubernetes/build.py --check  # exit 1 if they are stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RULES = ROOT / "deploy" / "prometheus"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
OUT = HERE / "base" / "monitoring"
WATCHDOG = RULES / "trainmon.watchdog.alerts.yml"
"""The Watchdog's rule file: in ``base/watchdog``, not ``base/monitoring``."""
LABELS = {"app.kubernetes.io/part-of": "trainmon"}
MAX_CONFIGMAP_BYTES = 256 * 1024
"""Largest dashboard ConfigMap accepted: ``kubectl apply`` (client side) copies the object
into its ``last-applied-configuration`` annotation, which Kubernetes caps at 256 KiB."""

SAMPLE_LIMITS = {"exporter": 10_000, "sidecar": 5_000}
"""Most samples per scrape of the node exporter (8 GPUs and 8 ranks with layers on one
rank are about 3,400, docs/scaling.md#cardinality-budget) and of a training pod's sidecar
(its own ranks, no GPU series). Each value becomes the PodMonitor's ``sampleLimit`` and the
exporter's ``scrape_sample_limit``: past it Prometheus would fail the whole scrape, so the
exporter sheds its least important series first (docs/exporter.md#the-sample-budget)."""
SAMPLE_LIMIT_ENV = "TRAINMON_SCRAPE_SAMPLE_LIMIT"

SCRAPERS: dict[str, dict[str, str]] = {
    "Prometheus (prometheus-operator: kube-prometheus, kube-prometheus-stack)": {
        "app.kubernetes.io/name": "prometheus"
    },
    "Prometheus in agent mode (PrometheusAgent; kube-prometheus-stack's agentMode)": {
        "app.kubernetes.io/name": "prometheus-agent"
    },
    "vmagent (VictoriaMetrics operator and its chart)": {"app.kubernetes.io/name": "vmagent"},
    "Grafana Alloy (its Helm chart)": {"app.kubernetes.io/name": "alloy"},
    "OpenTelemetry Collector (its Helm chart)": {
        "app.kubernetes.io/name": "opentelemetry-collector"
    },
    "OpenTelemetry Collector (the OpenTelemetry operator)": {
        "app.kubernetes.io/component": "opentelemetry-collector"
    },
}
"""The pod labels each scraper's own operator or chart gives its pods, in any namespace: the
peers the NetworkPolicies admit to the exporter's port."""
SCRAPER_LABEL = {"trainmon/scraper": "true"}
"""The label a platform team puts on any other scraper's pods (a renamed release, Datadog's
agent, a second Prometheus) to admit it: docs/scaling.md#network."""
EXPORTER_PORT = 9478


def rule_files() -> list[Path]:
    """The shipped rule files of ``base/monitoring``, in name order (the Watchdog's aside)."""
    files = [*RULES.glob("*.rules.yml"), *RULES.glob("*.alerts.yml")]
    return sorted(p for p in files if p != WATCHDOG)


def rule_object_name(path: Path) -> str:
    """``trainmon.alerts.yml`` -> ``trainmon-alerts`` (a DNS subdomain name)."""
    return path.name.removesuffix(".yml").replace(".", "-").replace("_", "-").lower()


def _header(sources: str) -> str:
    return (
        f"# Generated by deploy/kubernetes/build.py from {sources}.\n"
        "# Do not edit: change the sources and run python deploy/kubernetes/build.py.\n"
    )


class _Dumper(yaml.SafeDumper):
    """Block style (``|``) for multi-line strings, so PromQL and JSON stay readable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(docs: list[dict[str, Any]]) -> str:
    return "".join(
        "---\n" + yaml.dump(d, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)
        for d in docs
    )


def _prometheus_rule(path: Path) -> dict[str, Any]:
    """The ``PrometheusRule`` of one rule file."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": rule_object_name(path),
            "labels": {**LABELS, "app.kubernetes.io/name": rule_object_name(path)},
        },
        "spec": {"groups": yaml.safe_load(path.read_text())["groups"]},
    }


def prometheus_rules() -> str:
    """The ``PrometheusRule`` objects, as one multi-document YAML text."""
    docs = [_prometheus_rule(path) for path in rule_files()]
    return _header(
        "deploy/prometheus/*.rules.yml and *.alerts.yml, trainmon.watchdog.alerts.yml aside"
    ) + _dump(docs)


def watchdog_rule() -> str:
    """The Watchdog's ``PrometheusRule``, as YAML text."""
    return _header(f"deploy/prometheus/{WATCHDOG.name}") + _dump([_prometheus_rule(WATCHDOG)])


def dashboard_configmaps() -> str:
    """One ``ConfigMap`` per dashboard, as one multi-document YAML text.

    Raises:
        ValueError: a dashboard would make a ConfigMap over MAX_CONFIGMAP_BYTES.
    """
    docs = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        text = path.read_text()
        json.loads(text)  # a broken dashboard fails here, not in Grafana
        if len(text.encode()) > MAX_CONFIGMAP_BYTES - 4096:
            raise ValueError(f"{path.name} is too large for a ConfigMap applied client-side")
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": f"trainmon-dashboard-{path.stem}",
                    "labels": {**LABELS, "grafana_dashboard": "1"},
                    "annotations": {"grafana_folder": "trainmon"},
                },
                "data": {path.name: text},
            }
        )
    return _header("deploy/grafana/dashboards/*.json") + _dump(docs)


def _env_patch(kind: str, name: str, path: str, container: str, limit: int) -> dict[str, Any]:
    """A strategic-merge patch that sets the sample limit of one container of a workload.

    ``path``: ``containers`` or ``initContainers`` (a native sidecar).
    """
    env = [{"name": SAMPLE_LIMIT_ENV, "value": str(limit)}]
    api = "apps/v1" if kind == "DaemonSet" else "batch/v1"
    return {
        "apiVersion": api,
        "kind": kind,
        "metadata": {"name": name},
        "spec": {"template": {"spec": {path: [{"name": container, "env": env}]}}},
    }


def _podmonitor_patch(name: str, limit: int) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": name},
        "spec": {"sampleLimit": limit},
    }


def sample_limit_patches() -> dict[Path, str]:
    """``{path: text}`` of the patches that render each of :data:`SAMPLE_LIMITS` twice."""
    source = "SAMPLE_LIMITS in deploy/kubernetes/build.py"
    node, sidecar = SAMPLE_LIMITS["exporter"], SAMPLE_LIMITS["sidecar"]
    return {
        HERE / "base" / "exporter" / "sample-limit.yaml": _header(source)
        + _dump(
            [
                _env_patch("DaemonSet", "trainmon-exporter", "containers", "exporter", node),
                _podmonitor_patch("trainmon-exporter", node),
            ]
        ),
        HERE / "base" / "sidecar" / "sample-limit.yaml": _header(source)
        + _dump([_podmonitor_patch("trainmon-sidecar", sidecar)]),
        HERE / "examples" / "torchrun-job-sidecar" / "sample-limit.yaml": _header(source)
        + _dump([_env_patch("Job", "llm-pretrain", "initContainers", "trainmon", sidecar)]),
    }


def _scraper_peers() -> list[dict[str, Any]]:
    """One NetworkPolicy peer per scraper of :data:`SCRAPERS`, and one for
    :data:`SCRAPER_LABEL`, each in any namespace."""
    labels = [*SCRAPERS.values(), SCRAPER_LABEL]
    return [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(m)}} for m in labels]


def network_policies() -> dict[Path, str]:
    """``{path: text}`` of the node exporter's and the sidecars' NetworkPolicies."""
    source = "SCRAPERS and SCRAPER_LABEL in deploy/kubernetes/build.py"
    scrapers = "\n".join(f"#   - {name}" for name in SCRAPERS)
    about = (
        "# Only scrapers reach the exporter's port (its metrics, JSON API and status page), on\n"
        f"# TCP {EXPORTER_PORT}, from any namespace: pods labelled as\n{scrapers}\n"
        f"#   - and any pod a platform team labels {next(iter(SCRAPER_LABEL))}: "
        f'"{SCRAPER_LABEL["trainmon/scraper"]}".\n'
        "# Trainers use the Unix socket, which no NetworkPolicy sees; the kubelet's probes come\n"
        "# from the node and stay allowed. Takes effect where the network plugin enforces\n"
        "# NetworkPolicies. docs/scaling.md#network\n"
    )
    scrape_port = [{"port": EXPORTER_PORT, "protocol": "TCP"}]
    node = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "trainmon-exporter",
            "labels": {
                "app.kubernetes.io/name": "trainmon-exporter",
                **LABELS,
                "app.kubernetes.io/component": "exporter",
            },
        },
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "trainmon-exporter"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": _scraper_peers(), "ports": scrape_port}],
        },
    }
    others = [
        {"port": 1, "endPort": EXPORTER_PORT - 1, "protocol": "TCP"},
        {"port": EXPORTER_PORT + 1, "endPort": 65535, "protocol": "TCP"},
        {"protocol": "UDP"},
    ]
    sidecar = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": "trainmon-sidecar",
            "labels": {"app.kubernetes.io/name": "trainmon-sidecar", **LABELS},
        },
        "spec": {
            "podSelector": {"matchLabels": {"trainmon/sidecar": "true"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": _scraper_peers(), "ports": scrape_port},
                {"from": [{"podSelector": {}}], "ports": others},
            ],
        },
    }
    sidecar_about = about + (
        "# A NetworkPolicy that selects a pod isolates it: the second rule keeps what the\n"
        "# training pods of this namespace send each other (torchrun's rendezvous, NCCL and\n"
        "# gloo over TCP, UDP) on every other port. Where the namespace denies ingress by\n"
        "# default and admits its own pods otherwise, delete that rule.\n"
    )
    return {
        HERE / "base" / "exporter" / "networkpolicy.yaml": _header(source) + about + _dump([node]),
        HERE / "base" / "sidecar-networkpolicy" / "networkpolicy.yaml": _header(source)
        + sidecar_about
        + _dump([sidecar]),
    }


def render() -> dict[Path, str]:
    """``{output path: text}`` of every generated file."""
    return {
        OUT / "prometheusrules.yaml": prometheus_rules(),
        HERE / "base" / "watchdog" / "prometheusrule.yaml": watchdog_rule(),
        OUT / "dashboards.yaml": dashboard_configmaps(),
        **sample_limit_patches(),
        **network_policies(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = p.parse_args(argv)
    stale = []
    for path, text in render().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(text)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'} {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
