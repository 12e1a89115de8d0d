"""What rule files and dashboards may name, checked without starting an exporter.

A name used in a PromQL expression must be a series the exporter can expose (a row of
``trainmon_exporter.catalog``, with a histogram's ``_bucket``, ``_sum`` and ``_count``), a
recording rule of ``deploy/prometheus``, or one of the dcgm-exporter series the deployment
joins with. :func:`fleet_key_problems` checks that a query keys a run fleet-wide.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from trainmon_exporter.catalog import ALL

from .checkout import tracked

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_FILES = tracked("*.yml", under=ROOT / "deploy" / "prometheus")
"""Every Prometheus file of the deployment: configs, recording rules and alerts."""

DCGM_EXPORTER_NAMES = frozenset(
    {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"}
)
"""dcgm-exporter's series that the rules, dashboards and their docs join with trainmon's
(``rank:trainmon_rank_info:dcgm_uuid``): GPU utilisation, framebuffer used, tensor pipes."""

METRIC_NAME = re.compile(r"(?<![\w:])(?:[a-z_]+:)?(?:trainmon_|DCGM_)[\w:]*(?![\w:]|\.[\w+*])")
"""A series name of ours or dcgm-exporter's, or a recording rule built on one (``level:``);
not a regex (``trainmon_.+``) or a file name (``trainmon_slurm_sd.py``)."""


def catalog_series() -> set[str]:
    """Every series name the exporter can expose."""
    return {name for f in ALL for name in f.series}


def recorded_names() -> set[str]:
    """The names of every recording rule in the deployment's rule files."""
    names: set[str] = set()
    for path in PROMETHEUS_FILES:
        doc = yaml.safe_load(path.read_text()) or {}
        for group in doc.get("groups") or []:
            names |= {r["record"] for r in group["rules"] if "record" in r}
    return names


def known_names() -> set[str]:
    """What an expression may name: the catalog, the recording rules, dcgm-exporter's series."""
    return catalog_series() | recorded_names() | DCGM_EXPORTER_NAMES


def used_names(text: str) -> set[str]:
    """Series and recording-rule names in ``text`` (PromQL, or a file that holds some)."""
    return set(METRIC_NAME.findall(text))


FLEET_LABELS = ("cluster", "namespace")
"""Labels that, with ``run``, identify a run fleet-wide (the same run id may exist twice)."""


def fleet_key_problems(promql: str) -> list[str]:
    """Places in a PromQL expression (or a template that builds one) that key a run by ``run``
    without ``cluster`` and ``namespace``: a ``by``/``on`` clause naming ``run``, or a selector
    matching on ``run``. Returns them as text, [] when there are none.
    """
    problems = []
    for kind, labels in re.findall(r"\b(by|on)\s*\(([^)]*)\)", promql):
        names = {n.strip() for n in labels.split(",")}
        if "run" in names and not set(FLEET_LABELS) <= names:
            problems.append(f"{kind} ({labels})")
    for selector in re.findall(r"\{[^{}]*\}", promql):
        if re.search(r"\brun\s*=", selector) and not all(
            re.search(rf"\b{label}\s*=", selector) for label in FLEET_LABELS
        ):
            problems.append(selector)
    return problems
