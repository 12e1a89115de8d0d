"""The metric catalog is the one definition of every family: the golden exposition, the
collectors and the catalog agree on names, types, HELP and labels."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainmon_exporter import Settings, catalog
from trainmon_exporter.app import build_exporter
from trainmon_exporter.catalog import ALL, BY_NAME, NAMESPACE, Family

from ..conftest import ROOT, promtool_check_metrics
from ..fakes.nvml_backend import FakeGpu, FakeNvmlBackend
from ..helpers.checkout import tracked

GOLDEN = ROOT / "tests" / "golden" / "session.exposition.txt"
SRC = ROOT / "exporter" / "src" / "trainmon_exporter"

NOT_IN_GOLDEN: dict[str, str] = {}
"""Catalog families the golden session does not produce, with the reason (none today: the
session drives every collector, and families without samples still show HELP and TYPE)."""

COLLECTORS = {"training", "health", "layers", "rank_gpu", "gpu", "exporter", "process"}
INSTRUMENTS = {"ingest", "http", "log", "scrape", "exposition"}


def test_rows_are_unique_and_named_after_their_family() -> None:
    rows = {name: v for name, v in vars(catalog).items() if isinstance(v, Family)}
    assert len(ALL) == len(set(ALL)) == len(BY_NAME) == len(rows), "a row is missing or twice"
    assert set(rows.values()) == set(ALL)
    for const, f in rows.items():
        assert const == f.name.removeprefix("trainmon_").upper(), (const, f.name)
        assert f.type in ("gauge", "counter", "histogram"), f.name
        assert not f.name.endswith("_total"), f"{f.name}: a counter is named without _total"
        assert f.name.startswith("trainmon_") or f.collector == "process", f.name
        assert f.collector in COLLECTORS | INSTRUMENTS, f.name
        assert f.help and f.unit and f.doc, f.name
        assert "|" not in f.unit and "\n" not in f.doc, f.name  # one Markdown table cell each


NAME_LITERAL = re.compile(r"""(?<!\w)(f?)(["'])(trainmon_\w*)(\2|\{)""")
OWN_NAMES = re.compile(r"trainmon_(exporter|client)")  # the packages: modules, loggers


def name_literals(line: str) -> list[str]:
    """String literals in ``line`` that are a ``trainmon_`` name, or f-strings that build one."""
    return [
        m[0]
        for m in NAME_LITERAL.finditer(line)
        if (m[4] != "{" or m[1]) and not OWN_NAMES.fullmatch(m[3])
    ]


def test_no_metric_name_is_spelled_outside_the_catalog() -> None:
    """A literal that is a metric name outside catalog.py is a name spelled twice. Names in
    prose (a setting's description, a docstring) are documentation and stay allowed."""
    found = [
        f"{path.relative_to(ROOT)}:{n}: {literal}"
        for path in tracked("**/*.py", under=SRC)
        if path.name != "catalog.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for literal in name_literals(line)
    ]
    assert not found, "metric names outside catalog.py:\n" + "\n".join(found)
    bad = ('x = "trainmon_gpu_devices"', "f'trainmon_gpu_{name}'", '"trainmon_exporter_ranks"')
    for line in bad:
        assert name_literals(line), line  # the check can fail
    for line in ('getLogger("trainmon_exporter.nvml")', '"see trainmon_train_loss"', '"x"'):
        assert not name_literals(line), line


def test_the_golden_exposition_has_exactly_the_catalog_families() -> None:
    golden = {f.name: f for f in text_string_to_metric_families(GOLDEN.read_text())}
    missing = sorted(set(BY_NAME) - set(golden) - set(NOT_IN_GOLDEN))
    unknown = sorted(set(golden) - set(BY_NAME))
    assert not missing, f"catalog families the golden session does not show: {missing}"
    assert not unknown, f"families the exporter shows and the catalog lacks: {unknown}"
    assert not set(NOT_IN_GOLDEN) & set(golden), "listed as absent but present"
    for name, fam in golden.items():
        row = BY_NAME[name]
        assert (fam.type, fam.documentation) == (row.type, row.help), name
        for sample in fam.samples:
            implied = {"le"} if sample.name.endswith("_bucket") else set()
            # The golden session runs off Kubernetes: its ranks have no namespace and no pod,
            # and its one tenant is a uid.
            expected = (set(row.labels) - {NAMESPACE, "pod"}) | implied
            assert set(sample.labels) == expected, (name, sample.labels)


def test_promtool_accepts_the_golden_exposition() -> None:
    promtool_check_metrics(GOLDEN.read_text())


def test_each_collector_emits_exactly_its_catalog_rows(tmp_path: Path) -> None:
    """Every family a collector yields is a catalog row of that collector, with its labels."""
    ex = build_exporter(
        Settings(socket=tmp_path / "t.sock"), nvml=FakeNvmlBackend([FakeGpu(), FakeGpu()])
    )
    assert ex.gpus is not None and ex.gpus.open()
    try:
        ex.gpus.sample_once()
        by_collector: dict[str, set[str]] = {}
        for f in ALL:
            by_collector.setdefault(f.collector, set()).add(f.name)
        assert {c.name for c in ex.scrape.collectors} == COLLECTORS
        for c in ex.scrape.collectors:
            fams = list(c.collect())
            assert {m.name for m in fams} == by_collector[c.name], c.name
            for m in fams:
                labels = getattr(m, "_labelnames", None)
                if labels is not None:  # prometheus-client's own families do not keep them
                    assert tuple(labels) == BY_NAME[m.name].labels, m.name
        scrape = {m.name for m in ex.scrape.collect()} - {
            n for c in COLLECTORS for n in by_collector[c]
        }
        assert scrape == by_collector["scrape"]
    finally:
        ex.gpus.stop()


def test_a_row_builds_only_its_own_type() -> None:
    for family in ALL:
        build = {"gauge": family.gauge, "counter": family.counter, "histogram": family.histogram}
        assert build.pop(family.type)().name == family.name
        for other in build.values():
            with pytest.raises(TypeError):
                other()


def test_collectors_run_in_one_fixed_order_whatever_imported_them_first() -> None:
    code = (
        "import importlib, sys\n"
        "for m in reversed(sys.argv[1:]):\n"
        "    importlib.import_module('trainmon_exporter.collectors.' + m)\n"
        "from trainmon_exporter.collectors import ORDER, CollectorContext, build_collectors\n"
        "from trainmon_exporter.settings import Settings\n"
        "from trainmon_exporter.state.store import Store\n"
        "store = Store(max_ranks=8, max_custom_metrics=8, buckets=(1.0,), window_s=30, ttl_s=60)\n"
        "ctx = CollectorContext(Settings(collectors={'gpu': False}), store)\n"
        "print(' '.join(c.name for c in build_collectors(ctx)))\n"
    )
    from trainmon_exporter.collectors import ORDER

    out = subprocess.run(
        [sys.executable, "-c", code, *ORDER], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [n for n in ORDER if n != "gpu"], out.stdout


def test_the_clock_event_help_names_the_one_list_of_slowdown_reasons() -> None:
    from trainmon_exporter.nvml import CLOCK_EVENT_REASONS, SLOWDOWN_REASONS

    help_text = catalog.GPU_CLOCK_EVENT_REASON_ACTIVE.help
    slowing = help_text.split(");", 1)[1].split("slow training")[0]
    named = {r for r in CLOCK_EVENT_REASONS if re.search(rf"\b{r}\b", slowing)}
    assert named == set(SLOWDOWN_REASONS), named
