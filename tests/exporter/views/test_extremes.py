"""Every view survives every finite value: the sparklines, the cells, ``trainmon status`` and
the status page, over the whole float range (hypothesis), and end to end a rank that logs
-1e308 then +1e308 (the live view used to exit with a traceback for everyone watching, and
the page drew its sparklines with NaN coordinates)."""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from tests.conftest import InProcessExporter, connect, wait_for
from trainmon_exporter.views import sparkline, terminal
from trainmon_exporter.views.api import GpusResponse, RunsResponse, TrendMark, TrendView
from trainmon_exporter.views.cells import PAGE, TERMINAL
from trainmon_exporter.views.html import StatusPage, render_status

from ...helpers import views as v

MAX = 1.7976931348623157e308
EXTREMES = [MAX, -MAX, 1e308, -1e308, 5e-324, -5e-324, 2.2250738585072014e-308, 0.0, -0.0]
FINITE = st.one_of(
    st.sampled_from(EXTREMES), st.floats(allow_nan=False, allow_infinity=False, width=64)
)
"""Any finite float, the extremes drawn often: the largest, the smallest subnormal, zeros."""
SERIES = st.lists(st.one_of(st.none(), FINITE), min_size=1, max_size=80)
# A coordinate or size attribute of an SVG element, or a point of a polyline.
NAN = re.compile(r"\bnan\b(?!/inf)|(?<!nan/)\binf\b", re.I)
"""``nan`` or ``inf`` as a value (``NaN/Inf`` is the views' word for a logged one)."""
COORDINATES = re.compile(r"\b(?:x1|x2|y1|y2|cx|cy|x|y|width|height)='([^']*)'|points='([^']*)'")


def svg_numbers(svg: str) -> list[str]:
    """Every number an SVG places something at."""
    out = []
    for single, points in COORDINATES.findall(svg):
        out += [single] if single else re.split(r"[ ,]", points)
    return out


def assert_finite_svg(text: str) -> None:
    numbers = svg_numbers(text)
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", n) for n in numbers), numbers


@settings(max_examples=300, deadline=None)
@given(values=SERIES, width=st.integers(1, 80))
def test_sparklines_draw_any_finite_values(values: list[float | None], width: int) -> None:
    drawn = sparkline.blocks(values, width)
    assert len(drawn) == min(len(values), width)
    assert set(drawn) <= set(sparkline.BLOCKS) | {" "}
    present = [x for x in values if x is not None]
    if len(set(present)) > 1 and len(values) <= width:  # each value its own column
        assert drawn[values.index(min(present))] == "▁"
        assert drawn[values.index(max(present))] == "█"
    for column in sparkline.resample(values, width):
        assert column is None or min(present) <= column <= max(present)
    marks = [TrendMark(index=i, kind="spike", step=i) for i in range(0, len(values), 7)]
    assert_finite_svg(sparkline.svg(values, marks, list(range(len(values))), "loss"))
    assert not NAN.search(sparkline.range_text(values))


@settings(max_examples=300, deadline=None)
@given(x=FINITE, ratio=FINITE)
def test_cells_write_any_finite_value(x: float, ratio: float) -> None:
    rank = v.rank(
        values={"loss": x, "lr": x, "grad_norm": x},
        loss_ema=x,
        tokens_per_second=x,
        mfu_ratio=ratio,
        goodput=goodput_of(x, ratio),
    )
    for c in (PAGE, TERMINAL):
        for text in (
            c.number(x, ".4g"),
            c.logged(rank.values, "loss", ".4g"),
            c.percent(ratio),
            c.gib(x),
            c.mfu(rank),
            c.goodput(rank),
            c.throughput(rank, ",.0f"),
        ):
            assert text and not NAN.search(text), text


def goodput_of(x: float, ratio: float) -> Any:
    return v.goodput(
        ratio=ratio,
        productive_seconds=abs(x),
        uncheckpointed_seconds=abs(ratio),
        badput_seconds={"startup": abs(x), "hang": abs(ratio), "other": 0.0},
    )


def extreme_runs(losses: list[float | None], x: float, ratio: float) -> RunsResponse:
    n = len(losses)
    trend = TrendView(
        steps=list(range(n)),
        loss=losses,
        tokens_per_second=[None if y is None else abs(y) for y in losses],
        goodput=[None if y is None else ratio for y in losses],
        marks=[TrendMark(index=n - 1, kind="hang", step=n - 1)],
    )
    ranks = [
        v.rank(
            r,
            step=2**62,
            values={"loss": x, "lr": ratio, "grad_norm": x},
            loss_ema=x,
            tokens_per_second=abs(x),
            mfu_ratio=ratio,
            step_time_mean_seconds=abs(x),
            client_overhead_ratio=ratio,
            seconds_since_last_step=abs(ratio),
            goodput=goodput_of(x, ratio),
            trend=trend,
        )
        for r in range(2)
    ]
    return v.runs(*ranks)


def gpus_of(x: float) -> GpusResponse:
    return v.gpus(
        v.gpu(0, utilization_ratio=x, memory_used_bytes=abs(x), power_usage_watts=x),
        v.gpu(1, temperature_celsius=x, sm_clock_hertz=x, tensor_active_ratio=x),
    )


@settings(max_examples=60, deadline=None)
@given(losses=SERIES, x=FINITE, ratio=FINITE, width=st.sampled_from([40, 80, 120, 200]))
def test_trainmon_status_shows_any_finite_value(
    losses: list[float | None], x: float, ratio: float, width: int
) -> None:
    runs, gpus = extreme_runs(losses, x, ratio), gpus_of(x)
    console = Console(record=True, width=width, color_system=None)
    console.print(terminal.rich_view(runs, gpus, "http://127.0.0.1:9478"))
    text = console.export_text()
    assert "recent steps" in text
    assert not NAN.search(text), text
    assert not NAN.search(terminal.plain(runs, gpus))


@settings(max_examples=60, deadline=None)
@given(losses=SERIES, x=FINITE, ratio=FINITE)
def test_the_status_page_shows_any_finite_value(
    losses: list[float | None], x: float, ratio: float
) -> None:
    page = StatusPage(
        runs=extreme_runs(losses, x, ratio),
        gpus=gpus_of(x),
        socket="/run/trainmon/trainmon.sock",
        socket_problem=None,
        collectors={},
        gpu_state="sampling",
    )
    html = render_status(page)
    for svg in re.findall(r"<svg.*?</svg>", html, re.S):
        assert_finite_svg(svg)
    assert not NAN.search(html)


def test_a_rank_logging_the_float_range_end_to_end(exporter: InProcessExporter) -> None:
    """The case that was found: -1e308 then +1e308 from one rank, through a real exporter's
    API into the live view and onto the page."""
    run = connect(exporter, "extremes")
    for step, loss in enumerate([2.5, -1e308, 1e308, -MAX, MAX, 2.4]):
        run.log(step, loss=loss, grad_norm=abs(loss), tokens=1e308)
    run.finish()
    wait_for(lambda: (k := exporter.rank("extremes", 0)) and k["step"] == 5)
    runs = RunsResponse.model_validate(exporter.runs())
    (rank,) = runs.runs[0].ranks
    assert rank.trend.loss == [2.5, -1e308, 1e308, -MAX, MAX, 2.4]  # each point as logged
    gpus = GpusResponse.model_validate(exporter.client.get("/api/v1/gpus").json())
    for width in (80, 120):
        console = Console(record=True, width=width, color_system=None)
        console.print(terminal.rich_view(runs, gpus, "http://127.0.0.1:9478"))
        text = console.export_text()
        assert re.search(r"│ 0/1 +│ [▁▂▃▄▅▆▇█]+ ", text), text  # its loss sparkline drawn
        assert not NAN.search(text), text
    html = exporter.client.get("/").text
    for svg in re.findall(r"<svg.*?</svg>", html, re.S):
        assert_finite_svg(svg)
