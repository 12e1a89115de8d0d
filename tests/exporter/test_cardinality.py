"""The cardinality budget: series per rank, GPU, node, run and watched layer stay as published.

The budget constants are the figures measured on a real exporter (``tests/cardinality.py``
says how), published in docs/scaling.md#cardinality-budget. A change that adds series fails
here until the constants and the table are updated together, on purpose; a measurement that
finds far fewer series than budgeted fails too (the table would overstate the cost, or the
session that exercises every series broke).
"""

from __future__ import annotations

import math
import re

import pytest

from ..cardinality import Figures, measure
from ..conftest import ROOT

BUDGET = {"rank": 110, "GPU": 41, "node": 103, "run": 2, "layer": 15}
"""Series per unit; "rank" is a rank with every feature and ``watch()`` on (one tracked
operation), "layer" a watched layer with activations and gradient quantiles."""
SLACK = 0.8
"""A measured figure below ``SLACK x budget`` means the budget is stale (or the scenario broke)."""
GPUS_PER_NODE = 8
LAYERS = 128  # max_layers' default: the most a rank exports
GPUS_PER_RUN = 64  # runs of 8 nodes: the "layers on rank 0" column's assumption


def fleet(gpus: int, layers: str = "none") -> int:
    """Active series of a fleet of ``gpus`` GPUs, one rank per GPU, 8 GPUs a node.

    ``layers``: ``"none"``, ``"rank0"`` (the default ``layer_ranks``: rank 0 of each run of
    GPUS_PER_RUN ranks watches LAYERS layers) or ``"all"`` (every rank watches LAYERS layers).
    """
    b = BUDGET
    runs = math.ceil(gpus / GPUS_PER_RUN)
    total = gpus * (b["rank"] + b["GPU"]) + gpus // GPUS_PER_NODE * b["node"] + runs * b["run"]
    watching = {"none": 0, "rank0": runs, "all": gpus}[layers]
    return total + watching * LAYERS * b["layer"]


def table() -> str:
    """The fleet table of docs/scaling.md, computed from BUDGET."""

    def m(n: int) -> str:
        return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.0f} k"

    lines = [
        "| GPUs | nodes | runs | no layers | layers on rank 0 of each run | layers on every rank |",
        "|---|---|---|---|---|---|",
    ]
    for gpus in (1_000, 10_000):
        cells = [m(fleet(gpus, k)) for k in ("none", "rank0", "all")]
        lines.append(
            f"| {gpus:,} | {gpus // GPUS_PER_NODE:,} | {math.ceil(gpus / GPUS_PER_RUN)} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


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
