"""The docs cover everything the exporter exposes: every metric family and every setting."""

from __future__ import annotations

import importlib.util
import re
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


def settings_table() -> dict[str, tuple[str, str]]:
    """docs/exporter.md's settings table: ``{field name: (default cell, meaning cell)}``."""
    rows = {}
    for line in (ROOT / "docs" / "exporter.md").read_text().splitlines():
        m = re.match(
            r"\| `--(?:\[no-\])?([a-z][a-z0-9.-]*)[^|]*\| [^|]*\| ([^|]*) \| (.*) \|$", line
        )
        if m:
            rows[m.group(1).replace("-", "_")] = (m.group(2), m.group(3))
    return rows


def documented_default(value: Any) -> set[str]:
    """How docs/exporter.md may write ``value`` in its default column."""
    if isinstance(value, bool):
        return {"on"} if value else {"off"}
    if value is None or value == ():
        return {"–"}
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return {f"`{value}`", f"`{value}` (off)"}


def test_the_settings_table_agrees_with_the_help() -> None:
    """Each row of docs/exporter.md's table against the setting's --help text: the same
    default, and every counted reason the row names (`too_many_ranks`) in the help too."""
    table = settings_table()
    fields = {
        n: f for n, f in Settings.model_fields.items() if n not in ("collectors", "analytics")
    }
    fields |= {f"collectors.{n}": f for n, f in CollectorToggles.model_fields.items()}
    assert set(table) == set(fields)
    for name, field in fields.items():
        default_cell, meaning = table[name]
        help_text = field.description or ""
        default = field.get_default(call_default_factory=True)
        if name not in ("socket", "step_duration_buckets"):  # written out in words
            assert default_cell in documented_default(default), (name, default_cell, default)
        for reason in re.findall(r"\(`([a-z_]+)`\)", meaning):
            assert reason in help_text, f"--help of {name} does not name {reason}: {help_text}"
