"""The cardinality budget: series per rank, GPU, node, run and watched layer stay as published.

The budget constants are the figures measured on a real exporter (``tests/helpers/cardinality.py``
says how), published in docs/scaling.md#cardinality-budget. A change that adds series fails
here until the constants and the table are updated together, on purpose; a measurement that
finds far fewer series than budgeted fails too (the table would overstate the cost, or the
session that exercises every series broke).
"""

from __future__ import annotations

import re

import pytest

from ..conftest import ROOT
from ..helpers.cardinality import (
    BUDGET,
    GPUS_PER_NODE,
    LAYERS,
    SLACK,
    Figures,
    measure,
    table,
)


@pytest.fixture(scope="module")
def figures() -> Figures:
    return measure()


@pytest.mark.parametrize("unit", list(BUDGET))
def test_series_per_unit_stay_within_the_budget(figures: Figures, unit: str) -> None:
    got = dict(figures.rows())[unit]
    assert got <= BUDGET[unit], (
        f"{got} series per {unit}, budget {BUDGET[unit]}: a change added series. If on "
        "purpose, update BUDGET here and the table in docs/scaling.md#cardinality-budget"
    )
    assert got >= SLACK * BUDGET[unit], (
        f"only {got} series per {unit} against a budget of {BUDGET[unit]}: lower the budget "
        "and the published table, or fix the measuring session"
    )


def test_the_measurement_saw_every_unit(figures: Figures) -> None:
    assert figures.layers == 3  # the tiny model's three Linear layers, on rank 0 only
    assert figures.by_class["rank"] >= 8 * (BUDGET["rank"] - 5)  # 8 ranks, 5 from watch()


def test_the_published_table_is_the_budget() -> None:
    doc = (ROOT / "docs" / "scaling.md").read_text()
    section = doc.split("## Cardinality budget", 1)[1].split("\n## ", 1)[0]
    for unit, n in BUDGET.items():
        assert re.search(rf"^\| {unit}\b[^|]*\| {n} \|", section, re.M), (unit, n)
    assert table() in section, "docs/scaling.md's fleet table differs from:\n" + table()


def test_the_docs_quote_the_estimate_and_the_node_total_the_budget_gives() -> None:
    from trainmon_exporter.state.admission import (
        SERIES_PER_LAYER,
        SERIES_PER_OPERATION,
        SERIES_PER_RANK,
    )

    estimate = (
        f"{SERIES_PER_RANK} per rank, 1 per custom metric or evaluation value, "
        f"{SERIES_PER_OPERATION} per operation, {SERIES_PER_LAYER} per exported layer"
    )
    for doc in ("docs/exporter.md", "docs/metrics.md"):
        assert estimate in (ROOT / doc).read_text(), doc
    node = (
        GPUS_PER_NODE * (BUDGET["GPU"] + BUDGET["rank"])
        + BUDGET["node"]
        + BUDGET["run"]
        + LAYERS * BUDGET["layer"]
    )
    about = f"about {round(node, -2):,}"
    for doc in ("docs/scaling.md", "deploy/kubernetes/build.py"):
        text = " ".join((ROOT / doc).read_text().split())
        assert f"layers on one rank are {about}" in text or f"on one, is {about}" in text, doc
