"""The docs cover everything the exporter exposes: every metric family and every setting."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainmon_exporter.analytics import AnalyticsSettings
from trainmon_exporter.settings import CollectorToggles, Settings

from ..conftest import ROOT, InProcessExporter
from ..helpers.exporter import scripted_session


def test_every_metric_family_is_documented(exporter: InProcessExporter) -> None:
    scripted_session(exporter)
    doc = (ROOT / "docs" / "metrics.md").read_text()
    families = list(text_string_to_metric_families(exporter.metrics_text()))
    assert len(families) > 30
    missing = []
    for fam in families:
        name = fam.name + ("_total" if fam.type == "counter" else "")
        if f"`{name}`" not in doc:
            missing.append(name)
    assert not missing, f"undocumented in docs/metrics.md: {missing}"


def metrics_doc_generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "build_metrics_doc", ROOT / "scripts" / "build_metrics_doc.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_metric_tables_are_what_the_catalog_builds() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert metrics_doc_generator().render(doc) == doc, (
        "docs/metrics.md is stale: run python scripts/build_metrics_doc.py"
    )


def test_the_metric_tables_cannot_lose_a_section() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    gone = doc.replace("<!-- end catalog: layers -->", "")
    with pytest.raises(ValueError, match="layers"):
        metrics_doc_generator().render(gone)


def test_every_setting_is_documented() -> None:
    doc = (ROOT / "docs" / "exporter.md").read_text()
    for name in Settings.model_fields:
        if name in ("collectors", "analytics"):
            continue
        assert f"--{name.replace('_', '-')}" in doc, name
        assert f"TRAINMON_{name.upper()}" in doc, name
    for name in CollectorToggles.model_fields:
        assert f"TRAINMON_COLLECTORS__{name.upper()}" in doc, name


def test_every_analytics_setting_is_documented() -> None:
    doc = (ROOT / "docs" / "detection.md").read_text()
    for name in AnalyticsSettings.model_fields:
        assert f"`{name}`" in doc, name
