"""Sparklines from hand-built trends: block characters, marks under their points, the SVG."""

from __future__ import annotations

import re

import pytest

from trainmon_exporter.views import sparkline
from trainmon_exporter.views.api import TrendMark, TrendView


def test_blocks_span_the_range_from_the_lowest_to_the_highest() -> None:
    assert sparkline.blocks([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], 8) == "▁▂▃▄▅▆▇█"
    assert sparkline.blocks([8.0, None, 1.0], 8) == "█ ▁"  # a point without a value is a gap
    assert sparkline.blocks([3.0, 3.0, 3.0], 8) == "▄▄▄"  # flat
    assert sparkline.blocks([None, None], 8) == "  "
    assert sparkline.blocks([], 8) == ""


def test_resampling_averages_neighbours_into_the_width() -> None:
    values: list[float | None] = [float(i) for i in range(60)]
    cols = sparkline.resample(values, 20)
    assert len(cols) == 20 and cols[0] == pytest.approx(1.0) and cols[-1] == pytest.approx(58.0)
    assert sparkline.resample([1.0, None, None, 3.0], 2) == [1.0, 3.0]
    assert sparkline.resample([1.0, 2.0], 20) == [1.0, 2.0]  # never stretched
    assert len(sparkline.blocks(values, 11)) == 11


@pytest.mark.parametrize("width", [7, 11, 13, 20, 31, 43, 60, 80])
def test_a_mark_sits_under_the_character_drawn_from_its_point(width: int) -> None:
    for index in range(60):
        values: list[float | None] = [1.0] * 60
        values[index] = 100.0  # the one high point
        drawn = sparkline.blocks(values, width)
        letters = sparkline.mark_letters([TrendMark(index=index, kind="spike", step=7)], 60, width)
        high = max(range(len(drawn)), key=lambda c: sparkline.BLOCKS.index(drawn[c]))
        assert letters.index("S") == high, (width, index, drawn, letters)


def test_the_most_urgent_mark_wins_a_shared_column() -> None:
    marks = [
        TrendMark(index=10, kind="restart", step=10),
        TrendMark(index=11, kind="nonfinite", step=11),
        TrendMark(index=50, kind="hang", step=50),
        TrendMark(index=99, kind="spike", step=99),  # out of range: ignored
        TrendMark(index=3, kind="from_a_newer_exporter", step=3),  # unknown: ignored
    ]
    assert sparkline.mark_letters(marks, 60, 6) == " N   H"
    assert sparkline.resample_marks(marks, 60, 60)[10] == "restart"


def test_ranges_and_compact_numbers() -> None:
    assert sparkline.range_text([2.07, None, 5.9]) == "2.07–5.9"
    assert sparkline.range_text([65536.0, 65536.0]) == "65.5k"
    assert sparkline.range_text([None]) == "no values"
    assert [sparkline.compact(v) for v in (0.00312, 2.345, 999.0, 1234.0, 3.2e6, 4e9)] == [
        *["0.00312", "2.35", "999", "1.23k", "3.2M", "4G"]
    ]


def test_the_svg_draws_the_line_its_gaps_and_its_marks() -> None:
    values: list[float | None] = [5.0, 4.0, None, 3.0, 2.5, 2.0]
    marks = [
        TrendMark(index=2, kind="nonfinite", step=12),
        TrendMark(index=4, kind="restart", step=8),
    ]
    svg = sparkline.svg(values, marks, [10, 11, 12, 7, 8, 9], "loss")
    assert svg.startswith("<svg class='spark'") and svg.endswith("</svg>")
    assert "<script" not in svg and "href" not in svg  # nothing to run, nothing to fetch
    assert len(re.findall(r"<polyline points='([^']*)'", svg)) == 2  # broken at the gap
    assert "stroke='#c00'" in svg and ">N<title>NaN/Inf loss at step 12</title>" in svg
    assert "stroke='#0060c0'" in svg and "restart or rollback at step 8" in svg
    assert "aria-label='loss, steps 10 to 9, from 2 to 5; NaN/Inf loss at step 12;" in svg
    assert sparkline.svg([], [], [], "loss") == ""
    one = sparkline.svg([3.0], [], [4], "loss")  # a single point is a dot
    assert "<polyline" not in one and "<circle" in one


def test_values_that_are_not_finite_are_gaps_not_errors() -> None:
    # json.loads accepts NaN and Infinity: an answer from another server may hold them.
    inf, nan = float("inf"), float("nan")
    assert sparkline.blocks([1.0, inf, 2.0, nan, -inf], 8) == "▁ █  "
    assert sparkline.range_text([inf, 1.0]) == "1"
    svg = sparkline.svg([1.0, inf, 2.0, nan], [], [1, 2, 3, 4], "loss")
    assert "inf" not in svg and "nan" not in svg.lower().replace("nan/inf", "")


@pytest.mark.parametrize("width", [56, 60, 80])
def test_a_long_range_goes_under_its_sparkline_never_cut(width: int) -> None:
    """At 80 columns a range such as ``1.2e-05–0.00035`` left the sparkline 3 columns, and a
    longer one was cut with an ellipsis: it now goes on a line of its own, whole (folded
    after its dash where even that line is too narrow)."""
    from rich.console import Console

    from ...helpers import views as v

    series: list[list[float | None]] = [
        [1.23e-05 * (1 + i) for i in range(30)],
        [-1.7e308, *[1.7e308] * 29],
        [0.5] * 30,
    ]
    trend = TrendView(
        steps=list(range(30)), loss=series[0], tokens_per_second=series[1], goodput=series[2]
    )
    console = Console(record=True, width=width, color_system=None)
    console.print(sparkline.TerminalTrends(v.runs(v.rank(trend=trend))))
    screen = console.export_text()
    assert "…" not in screen, screen
    # Every number on screen is a whole bound of a range some drawn width gives.
    whole = {
        sparkline.compact(bound)
        for values in series
        for w in range(1, 31)
        for bound in (sparkline.span(sparkline.resample(values, w)) or ())
    }
    shown = re.findall(r"-?\d[\d.]*(?:e[-+]\d+)?[kMGT]?", re.sub(r"\d+/\d+", "", screen))
    assert shown and set(shown) <= whole, (sorted(set(shown) - whole), screen)
    for line in screen.splitlines():  # each sparkline keeps some columns
        cells = line.split("│")[2:5]
        blocks = [c.strip() for c in cells if c.strip() and c.strip()[0] in sparkline.BLOCKS]
        assert all(len(b.split(" ")[0]) >= sparkline.MIN_SPARK for b in blocks), line
