"""Sparklines of a rank's recent steps (:class:`~trainmon_exporter.views.api.TrendView`).

The status page draws them as inline SVG (no script, no external asset) and the terminal as
block characters (``▁▂▃▄▅▆▇█``) with a line of mark letters under them. Both mark the same
points: a NaN or infinite loss, a loss spike, a hang after the step and a restart. Each
sparkline is scaled to its own range, which the views print beside it.
"""

from __future__ import annotations

import html
import math
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

from trainmon_exporter.views.api import RunsResponse, TrendMark
from trainmon_exporter.views.cells import printable, shorten_middle

BLOCKS = "▁▂▃▄▅▆▇█"
"""Block characters from low to high."""
MARKS = {
    "nonfinite": ("N", "NaN/Inf loss", "#c00"),
    "spike": ("S", "loss spike", "#e07000"),
    "hang": ("H", "hang after this step", "#7a3fbf"),
    "restart": ("R", "restart or rollback", "#0060c0"),
}
"""Each mark kind's letter (terminal), words and colour (both views), in order of urgency:
where several fall on one character, the first is shown."""
FLOW = ("hang", "restart")
"""The marks the throughput sparkline shows too (the loss sparkline shows all)."""


def mean(values: Sequence[float]) -> float:
    """The mean of finite ``values`` (at least one), finite however large they are.

    ``sum(values) / n`` overflows to infinity for two values of 1e308: then each value is
    divided first. The result is kept within the values' range, which rounding can step past.
    """
    n = len(values)
    m = sum(values) / n
    if not math.isfinite(m):
        m = sum(v / n for v in values)
    lo, hi = min(values), max(values)
    return lo if m < lo else hi if m > hi else m


def fraction(v: float, lo: float, hi: float) -> float:
    """Where ``v`` lies between ``lo`` and ``hi`` (``lo < hi``, all finite), from 0 to 1.

    ``hi - lo`` overflows to infinity across the whole float range (-1e308 to 1e308), and
    ``(v - lo) / inf`` is 0 or NaN: the halves are subtracted instead, which never overflows.
    """
    d = hi - lo
    f = (v - lo) / d if math.isfinite(d) else (v / 2 - lo / 2) / (hi / 2 - lo / 2)
    return 0.0 if not f > 0.0 else 1.0 if f > 1.0 else f


def resample(values: Sequence[float | None], width: int) -> list[float | None]:
    """``values`` in at most ``width`` columns, each the mean of its values (None: none).

    A value that is not finite counts as missing (JSON from another server may hold one).
    """
    finite = [v if v is not None and math.isfinite(v) else None for v in values]
    n = len(finite)
    if n <= width:
        return finite
    out: list[float | None] = []
    for c in range(width):
        chunk = [v for v in finite[c * n // width : (c + 1) * n // width] if v is not None]
        out.append(mean(chunk) if chunk else None)
    return out


def resample_marks(marks: Sequence[TrendMark], points: int, width: int) -> list[str | None]:
    """The most urgent mark kind of each of ``min(points, width)`` columns (None: none).

    Columns group the points as :func:`resample` groups the values, so a mark sits under the
    character drawn from its point.
    """
    columns = min(points, width)
    bounds = [c * points // columns for c in range(columns + 1)]
    out: list[str | None] = [None] * columns
    order = list(MARKS)
    for m in marks:
        if not 0 <= m.index < points or m.kind not in MARKS:
            continue
        c = bisect_right(bounds, m.index) - 1
        if out[c] is None or order.index(m.kind) < order.index(out[c] or ""):
            out[c] = m.kind
    return out


def range_text(values: Sequence[float | None]) -> str:
    """The range a sparkline spans, ``2.07–5.9``, one number when flat, ``no values``."""
    rng = span(values)
    if rng is None:
        return "no values"
    lo, hi = (compact(v) for v in rng)
    return lo if lo == hi else f"{lo}–{hi}"


def span(values: Sequence[float | None]) -> tuple[float, float] | None:
    """``(low, high)`` of the values that are there; None when there are none."""
    present = [v for v in values if v is not None and math.isfinite(v)]
    return (min(present), max(present)) if present else None


def compact(v: float) -> str:
    """A number in at most about 5 characters: ``2.35``, ``0.0031``, ``123k``, ``1.2M``.

    Beyond a thousand T, and below 1e-4, in exponent form: ``1e+308``, ``-2.5e-07``.
    """
    a = abs(v)
    if a >= 1e15 or 0 < a < 1e-4:
        return f"{v:.2g}"
    for limit, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= limit:
            return f"{v / limit:.3g}{suffix}"
    return f"{v:.3g}"


def blocks(values: Sequence[float | None], width: int) -> str:
    """``values`` as block characters in at most ``width`` columns; a missing value is a space.

    Scaled from the lowest value (``▁``) to the highest (``█``); a flat line is ``▄``.
    """
    cols = resample(values, width)
    rng = span(cols)
    if rng is None:
        return " " * len(cols)
    lo, hi = rng
    top = len(BLOCKS) - 1
    out = []
    for v in cols:
        if v is None:
            out.append(" ")
        elif hi == lo:
            out.append(BLOCKS[top // 2])
        else:
            out.append(BLOCKS[round(fraction(v, lo, hi) * top)])
    return "".join(out)


def mark_letters(marks: Sequence[TrendMark], points: int, width: int) -> str:
    """The line under a block sparkline: each column's mark letter, spaces elsewhere."""
    kinds = resample_marks(marks, points, width)
    return "".join(" " if k is None else MARKS[k][0] for k in kinds).rstrip()


def svg(
    values: Sequence[float | None],
    marks: Sequence[TrendMark],
    steps: Sequence[int],
    what: str,
    width: int = 140,
    height: int = 30,
) -> str:
    """An inline SVG sparkline of ``values`` (one point each) with its marks.

    A line through the values that are there (broken where one is missing); a vertical line
    at each marked point in the mark's colour, with its words and step as a tooltip
    (``<title>``); the last value as a dot. ``what`` names the series for screen readers and
    tooltips. Empty string when there are no points.
    """
    n = len(values)
    if not n:
        return ""
    pad = 2.0
    rng = span(values)
    lo, hi = rng if rng is not None else (0.0, 1.0)

    def x(i: int) -> float:
        return pad + (width - 2 * pad) * (i / (n - 1) if n > 1 else 0.5)

    def y(v: float) -> float:
        if hi == lo:
            return height / 2
        return pad + (height - 2 * pad) * (1 - fraction(v, lo, hi))

    parts = []
    for m in marks:
        if not 0 <= m.index < n or m.kind not in MARKS:
            continue
        _, words, colour = MARKS[m.kind]
        dash = " stroke-dasharray='2 2'" if m.kind in ("hang", "restart") else ""
        parts.append(
            f"<line x1='{x(m.index):.1f}' y1='0' x2='{x(m.index):.1f}' y2='{height}' "
            f"stroke='{colour}' stroke-width='2'{dash}><title>{html.escape(words)} at step "
            f"{m.step}</title></line>"
        )
        if m.kind == "nonfinite":
            parts.append(
                f"<text x='{x(m.index) + 2:.1f}' y='9' font-size='10' fill='{colour}' "
                f"font-weight='bold'>N<title>{html.escape(words)} at step "
                f"{m.step}</title></text>"
            )
    runs: list[list[str]] = [[]]
    for i, v in enumerate(values):
        if v is None or not math.isfinite(v):
            runs.append([])
        else:
            runs[-1].append(f"{x(i):.1f},{y(v):.1f}")
    for run in runs:
        if len(run) > 1:
            parts.append(
                f"<polyline points='{' '.join(run)}' fill='none' stroke='#333' stroke-width='1.2'/>"
            )
        elif run:
            cx, cy = run[0].split(",")
            parts.append(f"<circle cx='{cx}' cy='{cy}' r='1.2' fill='#333'/>")
    last = next(
        (
            (i, v)
            for i, v in reversed(list(enumerate(values)))
            if v is not None and math.isfinite(v)
        ),
        None,
    )
    if last is not None:
        parts.append(f"<circle cx='{x(last[0]):.1f}' cy='{y(last[1]):.1f}' r='2' fill='#070'/>")
    first_step = steps[0] if steps else "?"
    last_step = steps[-1] if steps else "?"
    label = (
        f"{what}, steps {first_step} to {last_step}"
        + (f", from {compact(lo)} to {compact(hi)}" if rng is not None else ", no values")
        + "".join(f"; {MARKS[m.kind][1]} at step {m.step}" for m in marks if m.kind in MARKS)
    )
    return (
        f"<svg class='spark' width='{width}' height='{height}' viewBox='0 0 {width} {height}' "
        f"role='img' aria-label='{html.escape(label)}' xmlns='http://www.w3.org/2000/svg'>"
        f"<title>{html.escape(label)}</title>{''.join(parts)}</svg>"
    )


MIN_SPARK = 6
"""Fewest columns a sparkline keeps beside its range; narrower, the range goes under it."""
_MARK_LEGEND = {"N": "NaN/Inf", "S": "loss spike", "H": "hang", "R": "restart or rollback"}
_MARK_STYLES = {
    "nonfinite": "bold red",
    "spike": "dark_orange",
    "hang": "magenta",
    "restart": "blue",
}


class TerminalTrends:
    """The sparklines of every rank: loss, tokens/s and goodput over its recent steps.

    Fitted to the width at render time, each with the range it draws, and a line of mark
    letters under a sparkline that has marks. The run column is shown only when more than
    one run has ranks (the ranks table above names the run).
    """

    def __init__(self, runs: RunsResponse, run_width: int = 20) -> None:
        self.run_width = run_width
        self.ranks = [
            (printable(run.label), f"{r.rank}/{r.world_size}", r)
            for run in runs.runs
            for r in run.ranks
            if r.trend.steps
        ]

    @staticmethod
    def _cell(
        values: list[float | None], marks: list[Any], points: int, width: int, room: int
    ) -> Any:
        """Block characters, then the range they draw, in a cell ``width`` wide.

        The range takes ``room`` columns beside the sparkline where that leaves the sparkline
        :data:`MIN_SPARK` columns or more and the range fits; else the sparkline takes the
        whole width and the range goes on a line of its own under it (two, folded after its dash,
        where one is too narrow). A number is never cut.
        """
        from rich.text import Text

        beside = width - room >= MIN_SPARK
        spark_w = width - room if beside else width
        rng = range_text(resample(values, spark_w))
        if beside and len(rng) >= room:
            beside, spark_w = False, width
            rng = range_text(resample(values, spark_w))
        text = Text(blocks(values, spark_w).ljust(spark_w), style="green")
        if beside:
            text.append(" " + rng.ljust(room - 1), style="dim")
        kinds = resample_marks(marks, points, spark_w)
        if any(kinds):
            text.append("\n")
            for k in kinds:
                text.append(" " if k is None else MARKS[k][0], _MARK_STYLES.get(k or "", ""))
            text.rstrip()
        if not beside:  # on a line of its own, or two where even that is too narrow
            lo, dash, hi = rng.partition("–")
            shown = f"{lo}{dash}\n{hi}" if len(rng) > width and dash else rng
            text.append("\n" + shown, style="dim")
        return text

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.table import Table

        if not self.ranks:
            return
        runs = len({run for run, _, _ in self.ranks})
        run_w = min(max(len(run) for run, _, _ in self.ranks), self.run_width) if runs > 1 else 0
        rank_w = max(4, *(len(label) for _, label, _ in self.ranks))
        columns = 5 if run_w else 4
        per_series = max(12, (options.max_width - 1 - columns * 3 - run_w - rank_w) // 3)
        keys = ("loss", "tokens_per_second", "goodput")
        # The range beside a sparkline is that of the columns drawn: room for the longest.
        rooms = [
            1
            + max(
                len(range_text(resample(getattr(r.trend, key), per_series - 12)))
                for _, _, r in self.ranks
            )
            for key in keys
        ]
        legend = " · ".join(f"{letter} {short}" for letter, short in _MARK_LEGEND.items())
        table = Table(title="recent steps, oldest left", caption=f"marks: {legend}")
        if run_w:
            table.add_column("run", width=run_w, no_wrap=True, overflow="ignore")
        table.add_column("rank", width=rank_w, no_wrap=True)
        table.add_column("loss", width=per_series, no_wrap=True, overflow="ellipsis")
        table.add_column("tokens/s", width=per_series, no_wrap=True, overflow="ellipsis")
        table.add_column("goodput", width=per_series, no_wrap=True, overflow="ellipsis")
        prev = None
        for run, label, r in self.ranks:
            t = r.trend
            n = len(t.steps)
            flow = [m for m in t.marks if m.kind in FLOW]
            cells = [
                label,
                self._cell(t.loss, t.marks, n, per_series, rooms[0]),
                self._cell(t.tokens_per_second, flow, n, per_series, rooms[1]),
                self._cell(t.goodput, flow, n, per_series, rooms[2]),
            ]
            if run_w:
                cells.insert(0, "" if run == prev else shorten_middle(run, run_w))
            table.add_row(*cells)
            prev = run
        yield table
