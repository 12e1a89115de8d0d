"""docs/scaling.md's job-turnover table follows from the measured series budget.

The per-unit budget (``tests/helpers/cardinality.py``, held to a real exporter by
tests/exporter/test_cardinality.py), the exporter's default ``series_ttl_seconds`` and
Prometheus's head compaction give the head series at the peak; the memory column multiplies
them by the bytes per head series that ``benchmarks/prometheus_memory.py`` measured.
"""

from __future__ import annotations

import math
import re

from trainmon_exporter.settings import Settings

from ..conftest import ROOT
from ..helpers.cardinality import BUDGET, GPUS_PER_NODE, GPUS_PER_RUN, fleet

DOC = ROOT / "docs" / "scaling.md"
HEAD_LINGER_HOURS = 3.0
"""The longest a series without new samples stays in a Prometheus head: the head is compacted
when it spans 1.5 x the 2-hour block range, and keeps its last hour."""
BYTES_PER_HEAD_SERIES = 2989
"""Resident memory per added head series, measured by benchmarks/prometheus_memory.py (the
figure docs/scaling.md quotes)."""


def head_series(gpus: int, job_hours: float, linger_hours: float = HEAD_LINGER_HOURS) -> int:
    """Head series at the peak: ``1 + (TTL + linger) / job length`` generations of rank and
    run series, and the GPU and node series once."""
    ttl_hours = Settings().series_ttl_seconds / 3600
    generations = 1 + (ttl_hours + linger_hours) / job_hours
    runs = math.ceil(gpus / GPUS_PER_RUN)
    turning = gpus * BUDGET["rank"] + runs * BUDGET["run"]
    fixed = gpus * BUDGET["GPU"] + gpus // GPUS_PER_NODE * BUDGET["node"]
    return round(generations * turning) + fixed


def m(n: float) -> str:
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.0f} k"


def section() -> str:
    text = DOC.read_text()
    start = text.index("### Job turnover")
    end = text.find("\n## ", start)
    return text[start : end if end >= 0 else len(text)]


def test_the_turnover_table_follows_from_the_budget() -> None:
    rows = re.findall(
        r"^\| ([\d,]+) \| (\d+) h \| ([\d.]+ [kM]) \| ([\d.]+ [kM]) \| ([\d.]+) GB \|$",
        section(),
        re.M,
    )
    assert len(rows) == 3, rows
    for gpus_text, hours, running, head, memory in rows:
        gpus = int(gpus_text.replace(",", ""))
        expected = head_series(gpus, float(hours))
        assert running == m(fleet(gpus)), (gpus, hours)
        assert head == m(expected), (gpus, hours, m(expected))
        assert memory == f"{expected * BYTES_PER_HEAD_SERIES / 1e9:.1f}", (gpus, hours)
    assert f"{BYTES_PER_HEAD_SERIES:,} bytes per" in section()


def test_the_prose_quotes_the_table() -> None:
    text = section()
    worst, mean = head_series(10_000, 1), head_series(10_000, 1, linger_hours=2.0)
    assert f"{m(mean)} on average for\n10,000 GPUs and 1-hour jobs" in text
    assert f"{m(worst)} series need about\n  {worst * BYTES_PER_HEAD_SERIES / 1e9:.0f} GB" in text
    # turnover is what the budget is about: the peak is several times the running ranks
    assert head_series(10_000, 1) > 3 * fleet(10_000)
