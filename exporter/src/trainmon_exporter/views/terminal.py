"""``trainmon status``: runs, ranks and GPUs in a terminal, for a node with no Grafana.

Why this module is one module of about 620 lines: it is everything the command prints and
parses (the ``--once`` table, the live view's fitted tables of ranks, of where their time
went and of GPUs, the hang section over every exporter read, the commands and flags with their
suggestions), and the tables share one
fitting rule and one set of cells; what the page shares with it is in
:mod:`~trainmon_exporter.views.cells`, the sparklines in :mod:`~trainmon_exporter.views.sparkline`.

    trainmon status [--url http://127.0.0.1:9478] [--interval 2]   # live view (rich), Ctrl-C
    trainmon status --once                                         # one plain snapshot
    trainmon status --url https://node1:9478 --ca-file ca.crt --user prometheus  # TLS, auth
    trainmon status --url node1:9478 --url node2:9478 --once    # a multi-node job's hangs

Reads ``/api/v1/runs`` and ``/api/v1/gpus`` of a running exporter (also reachable as
``trainmon-exporter status``) into the API's own models (:mod:`trainmon_exporter.views.api`)
and writes their cells as the status page does (:mod:`trainmon_exporter.views.cells`).
``--once`` prints whitespace-separated columns with a header line, ``-`` for a missing value
and no colour, so scripts can parse it; rows are sorted by run and rank, then GPUs by index.
An exporter with a web configuration file is read over HTTPS (``--ca-file`` for a private CA)
with basic auth (``--user``; the password from ``TRAINMON_STATUS_PASSWORD`` or
``--password-file``, never a flag: other users can read a command line).

This module loads neither the daemon (FastAPI, uvicorn, prometheus_client, pynvml) nor the
settings model, so the command starts fast; rich is imported when the live view first draws.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from trainmon_exporter.views import sparkline
from trainmon_exporter.views.api import GpusResponse, GpuView, RunsResponse
from trainmon_exporter.views.cells import (
    NONFINITE,
    TERMINAL,
    TIME_PARTS,
    printable,
    rank_status,
    shorten_middle,
    time_bar,
    time_part,
    time_shares,
    time_words,
)
from trainmon_exporter.views.hangs import merge_runs, text_lines
from trainmon_exporter.views.remote import (
    DEFAULT_URL,
    PASSWORD_VARIABLE,
    StatusError,
    access_from,
    fetch,
    fetch_runs,
    normalise_url,
)

RANK_COLUMNS = (
    "run",
    "rank",
    "host",
    "status",
    "step",
    "loss",
    "loss_ema",
    "tokens_per_s",
    "mfu",
    "goodput",
    "gpu",
    "gpu_util",
    "gpu_mem",
    "anomalies",
)
GPU_COLUMNS = (
    "gpu",
    "name",
    "util",
    "tensor",
    "mem_used_gib",
    "mem_total_gib",
    "power_w",
    "temp_c",
    "slowdown",
    "xids",
)


def rank_rows(runs: RunsResponse, gpus: GpusResponse) -> list[dict[str, str]]:
    """One row per rank (keys: :data:`RANK_COLUMNS`), every value formatted and printable."""
    c = TERMINAL
    by_index = {g.index: g for g in gpus.gpus}
    rows = []
    for run in runs.runs:
        for r in run.ranks:
            g = None if r.gpu is None else by_index.get(r.gpu)
            mem = None
            if g is not None and g.memory_used_bytes is not None and g.memory_size_bytes:
                mem = g.memory_used_bytes / g.memory_size_bytes
            anomalies = list(r.health)
            if r.events:
                last = r.events[-1]
                anomalies.append(f"last event {last.kind} at step {last.step}")
            rows.append(
                {
                    "run": run.label,
                    "rank": f"{r.rank}/{r.world_size}",
                    "host": r.hostname or c.missing,
                    "status": rank_status(r),
                    "step": c.missing if r.step is None else str(r.step),
                    "loss": c.logged(r.values, "loss", ".4g"),
                    "loss_ema": c.number(r.loss_ema, ".4g"),
                    "tokens_per_s": c.throughput(r, ".0f"),
                    "mfu": c.mfu(r),
                    "goodput": c.goodput(r),
                    "gpu": c.missing if r.gpu is None else str(r.gpu),
                    "gpu_util": c.missing if g is None else c.percent(g.utilization_ratio),
                    "gpu_mem": c.percent(mem),
                    "anomalies": "; ".join(anomalies) or "ok",
                }
            )
    return [{k: printable(v) for k, v in row.items()} for row in rows]


def _gpu_row(g: GpuView) -> dict[str, str]:
    c = TERMINAL
    row = {
        "gpu": str(g.index),
        "name": g.name,
        "util": c.percent(g.utilization_ratio),
        "tensor": c.percent(g.tensor_active_ratio),
        "mem_used_gib": c.gib(g.memory_used_bytes),
        "mem_total_gib": c.gib(g.memory_size_bytes),
        "power_w": c.number(g.power_usage_watts, ".0f"),
        "temp_c": c.number(g.temperature_celsius, ".0f"),
        "slowdown": ",".join(g.slowdown_reasons) or "none",
        "xids": str(g.xid_errors),
    }
    return {k: printable(v) for k, v in row.items()}


def gpu_rows(gpus: GpusResponse) -> list[dict[str, str]]:
    """One row per GPU of the last NVML sample (keys: :data:`GPU_COLUMNS`), by index, printable."""
    return [_gpu_row(g) for g in sorted(gpus.gpus, key=lambda g: g.index)]


def hang_lines(nodes: Sequence[RunsResponse]) -> list[str]:
    """The ``# hangs`` section: one merged view per run with hang evidence, over ``nodes``.

    Each run's ranks from every exporter read (one ``--url`` per node of a multi-node job)
    are merged (:func:`~trainmon_exporter.views.hangs.merge_runs`); [] when no run has any.
    """
    runs = merge_runs(nodes)
    if not runs:
        return []
    now = max(n.time for n in nodes)
    out = ["# hangs"]
    for run in runs:
        out += [printable(line) for line in text_lines(run, now)]
    return out


def plain(
    runs: RunsResponse, gpus: GpusResponse, more: Sequence[tuple[RunsResponse, GpusResponse]] = ()
) -> str:
    """The ``--once`` snapshot: a ranks section, then a GPUs section, then hangs if any.

    Columns are separated by two spaces or more (values never contain two spaces); ``-``
    stands for a missing value. ``more``: the other exporters read (``--url`` again): their
    ranks follow in the same table, their GPUs each in a section of its own, and the hangs
    section merges every exporter's ranks of a run.
    """

    def table(columns: Sequence[str], rows: list[dict[str, str]]) -> list[str]:
        cells = [list(columns)] + [[row[c].replace("  ", " ") for c in columns] for row in rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
        return [
            "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
            for line in cells
        ]

    nodes = [(runs, gpus), *more]
    rows = [row for r, g in nodes for row in rank_rows(r, g)]
    lines = ["# ranks", *table(RANK_COLUMNS, rows)]
    for i, (r, _) in enumerate(nodes):
        which = f" of exporter {i + 1}" if more else ""
        jobs = [printable(line) for run in r.runs if (line := TERMINAL.job(run))]
        if jobs:
            lines += ["", f"# jobs{which}", *jobs]
    for i, (_, g) in enumerate(nodes):
        which = f" of exporter {i + 1}" if more else ""
        lines.append("")
        if g.ok:
            driver = printable(g.driver_version) or "?"
            lines.append(f"# gpus{which} (driver {driver}, {g.lost_total} lost)")
            lines += table(GPU_COLUMNS, gpu_rows(g))
        else:
            lines.append(f"# gpus{which}: none ({printable(g.error) or 'GPU sampling off'})")
    hangs = hang_lines([r for r, _ in nodes])
    if hangs:
        lines += ["", *hangs]
    return "\n".join(lines) + "\n"


class Column(NamedTuple):
    """A column of the live view.

    Lower ``priority`` numbers are kept first when the terminal is narrow; a column that does
    not fit whole is dropped (and named in the caption), never squeezed, so a number is never
    cut into another number. Only text columns (``wraps``) wrap, and only between words (their
    minimum width is their longest word). A ``kept`` column is never dropped: a narrow
    terminal shortens it (``shortens``: long values lose their middle, as run ids do) or folds
    its words instead.
    """

    key: str
    header: str
    priority: int
    wraps: bool
    kept: bool = False
    shortens: bool = False


LIVE_RANK_COLUMNS = (
    Column("run", "run", 0, False, kept=True, shortens=True),
    Column("rank", "rank", 1, False, kept=True),
    Column("host", "host", 9, False),
    Column("status", "status", 2, False, kept=True),
    Column("step", "step", 3, False),
    Column("loss", "loss", 4, False),
    Column("loss_ema", "loss ema", 12, False),
    Column("tokens_per_s", "tokens/s", 6, False),
    Column("mfu", "mfu", 7, False),
    Column("gpu", "gpu", 10, False),
    Column("gpu_util", "gpu util", 11, False),
    Column("gpu_mem", "gpu mem", 13, False),
    Column("anomalies", "anomalies", 5, True, kept=True),
)
LIVE_GPU_COLUMNS = (
    Column("gpu", "gpu", 0, False, kept=True),
    Column("name", "name", 6, True),
    Column("util", "util", 1, False),
    Column("tensor", "tensor", 7, False),
    Column("mem_used_gib", "mem GiB", 3, False),
    Column("mem_total_gib", "of GiB", 4, False),
    Column("power_w", "W", 8, False),
    Column("temp_c", "°C", 5, False),
    Column("slowdown", "slowdown", 2, True),
    Column("xids", "xids", 2, False),
)
# A bordered table with one space of padding each side: 3 cells per column plus one border.
_CELL_OVERHEAD = 3
SHORT_RUN = 20
"""Width a long run id is shortened to before any optional column is given up for it; space
left over widens it again (a generated id is 43 characters)."""
FOLD_MIN = 8
"""Narrowest a kept text column is folded to when even the kept columns do not fit."""


def _cell_width(text: str, wraps: bool) -> int:
    """Width a cell needs: all of it, or for a wrapping column its longest word."""
    from rich.cells import cell_len

    if wraps:
        return max((cell_len(w) for w in text.split()), default=0)
    return cell_len(text)


def fit_columns(
    spec: Sequence[Column], rows: list[dict[str, str]], width: int
) -> tuple[list[tuple[str, str, int, bool]], list[str]]:
    """The columns of ``spec`` that fit in ``width`` terminal cells, with their widths.

    Kept columns are always shown, a shortening one at no more than :data:`SHORT_RUN`; the
    others are taken by priority while the table's minimum width (every cell whole, text
    wrapped between words) stays within ``width``, and not past the first that does not fit:
    a column is never hidden while a less urgent one is shown. Space left over widens the text
    columns up to their longest value, then the shortened ones back to theirs. When even the
    kept columns do not fit, the shortening ones give way down to their header and the wrapping
    ones are folded down to :data:`FOLD_MIN`. Returns ``(shown, dropped_headers)``, ``shown`` as
    ``(key, header, width, wraps)`` in display order.
    """
    from rich.cells import cell_len

    def need(c: Column, wraps: bool) -> int:
        return max([_cell_width(c.header, wraps)] + [_cell_width(r[c.key], wraps) for r in rows])

    minimum = {c.key: need(c, c.wraps) for c in spec}
    for c in spec:
        if c.shortens:
            minimum[c.key] = min(minimum[c.key], max(SHORT_RUN, cell_len(c.header)))
    by_priority = sorted(spec, key=lambda c: c.priority)
    kept = [c for c in by_priority if c.kept] or by_priority[:1]
    keep = {c.key for c in kept}
    budget = width - 1 - sum(minimum[k] + _CELL_OVERHEAD for k in keep)  # 1: the left border
    for c in kept:  # too narrow even for these: shorten, then fold
        if budget >= 0:
            break
        floor = max(cell_len(c.header), 4) if c.shortens else FOLD_MIN if c.wraps else None
        if floor is not None and minimum[c.key] > floor:
            give = min(minimum[c.key] - floor, -budget)
            minimum[c.key] -= give
            budget += give
    for c in by_priority:
        if c.key in keep:
            continue
        cost = minimum[c.key] + _CELL_OVERHEAD
        if cost > budget:
            break  # the rest are less urgent: hidden too, so the order holds at any width
        keep.add(c.key)
        budget -= cost
    widths = dict(minimum)
    growing = [c for c in by_priority if c.wraps] + [c for c in by_priority if c.shortens]
    for c in growing:
        if c.key in keep and budget > 0:
            grow = max(0, min(budget, need(c, False) - widths[c.key]))
            widths[c.key] += grow
            budget -= grow
    shown = [(c.key, c.header, widths[c.key], c.wraps) for c in spec if c.key in keep]
    dropped = [c.header for c in spec if c.key not in keep]
    return shown, dropped


class _FittedTable:
    """A rich renderable that picks its columns for the width it is given at render time."""

    def __init__(
        self,
        title: str | None,
        spec: Sequence[Column],
        rows: list[dict[str, str]],
        styles: list[tuple[str, dict[str, str]]],
        caption: str | None,
    ) -> None:
        self.title, self.spec, self.rows = title, spec, rows
        self.styles, self.caption = styles, caption

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.table import Table
        from rich.text import Text

        shown, dropped = fit_columns(self.spec, self.rows, options.max_width)
        notes = [self.caption] if self.caption else []
        if dropped:
            notes.append(f"hidden for width: {', '.join(dropped)} (widen the terminal or --once)")
        table = Table(title=self.title, caption=" ".join(notes) or None)
        for _key, header, width, wraps in shown:
            # Widths are set here, not left to rich, which would squeeze any column to fit.
            table.add_column(
                header, width=width, no_wrap=not wraps, overflow="fold" if wraps else "ignore"
            )
        shortens = {c.key for c in self.spec if c.shortens}
        for row, (style, cell_styles) in zip(self.rows, self.styles, strict=True):
            cells = []
            for key, _, width, _ in shown:
                cell = Text(shorten_middle(row[key], width) if key in shortens else row[key])
                if key in cell_styles:
                    cell.stylize(cell_styles[key])
                cells.append(cell)
            table.add_row(*cells, style=style)
        yield table


MIN_WORDS = 24
"""Narrowest the parts' words get a column of their own beside the bar; narrower, they go
under it."""


class TimeTable:
    """Where each rank's time went since its ``init()``: its goodput, a bar, every part.

    Always shown, whatever the width (the ranks table above has no goodput column to hide):
    the goodput figure (``--once``'s ``goodput`` without the largest badput, which leads the
    parts), then a bar a quarter of the terminal wide (10 to 40 cells), a block for productive
    time (``█``, ``▓`` uncheckpointed) and a letter for each kind of badput
    (:data:`~trainmon_exporter.views.cells.TIME_PARTS`, named in the caption), each in its
    colour, then every part with its share: productive, uncheckpointed, then the badput kinds
    from the largest. The run column is shown only when more than one run has ranks.
    """

    def __init__(self, runs: RunsResponse, run_width: int = 20) -> None:
        self.run_width = run_width
        self.ranks = [
            (printable(run.label), f"{r.rank}/{r.world_size}", r.goodput, shares)
            for run in runs.runs
            for r in run.ranks
            if r.goodput is not None and (shares := time_shares(r.goodput))
        ]

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.table import Table
        from rich.text import Text

        if not self.ranks:
            return
        runs = len({run for run, _, _, _ in self.ranks})
        run_w = min(max(len(r[0]) for r in self.ranks), self.run_width) if runs > 1 else 0
        rank_w = max(4, *(len(label) for _, label, _, _ in self.ranks))
        bar_w = max(10, min(40, options.max_width // 4))
        fixed = 1 + (run_w + 3 if run_w else 0) + rank_w + 3 + len("goodput") + 3
        narrow = options.max_width - fixed - (bar_w + 3) - 3 < MIN_WORDS
        if narrow:  # the parts in words go under the bar, in one column as wide as it can be
            bar_w = max(1, min(40, options.max_width - fixed - 3))
        used = {k for *_, shares in self.ranks for k, _ in shares}
        legend = " · ".join(
            f"{time_part(k)[0]} {time_part(k)[1]}"
            for k in [*TIME_PARTS, *sorted(used - set(TIME_PARTS))]
            if k in used
        )
        table = Table(title="where the time went, since each rank's init()", caption=legend)
        if run_w:
            table.add_column("run", width=run_w, no_wrap=True, overflow="ignore")
        table.add_column("rank", width=rank_w, no_wrap=True)
        table.add_column("goodput", width=len("goodput"), no_wrap=True)  # ≤ "100.0%"
        if narrow:
            table.add_column("time, share of the wall-clock", width=bar_w, overflow="fold")
        else:
            table.add_column("time", width=bar_w, no_wrap=True, overflow="ignore")
            table.add_column("share of the wall-clock", overflow="fold")
        prev = None
        for run, label, goodput, shares in self.ranks:
            bar = Text()
            for part in time_bar(shares, bar_w):
                char, _, colour = time_part(part)
                bar.append(char, style=colour)
            words = time_words(shares, TERMINAL.gap)
            if narrow:
                bar.append("\n" + words)
            cells = [label, TERMINAL.percent(goodput.ratio), *([bar] if narrow else [bar, words])]
            if run_w:
                cells.insert(0, "" if run == prev else shorten_middle(run, run_w))
            table.add_row(*cells)
            prev = run
        yield table


def _line(text: str, style: str = "") -> Any:
    """One line of text, cut with ``…`` at the terminal's width rather than wrapped."""
    from rich.text import Text

    return Text(text, style=style, no_wrap=True, overflow="ellipsis")


def gpu_line(gpus: GpusResponse) -> str | None:
    """The one line the live view shows instead of the GPU table when there is none to show."""
    if not gpus.ok:
        hint = f" Hint: {gpus.hint}" if gpus.hint else ""
        return printable(f"GPUs: no GPU metrics ({gpus.error or 'GPU sampling off'}).{hint}")
    if not gpus.gpus:
        return "GPUs: NVML sees no GPU on this node."
    return None


def rich_view(
    runs: RunsResponse, gpus: GpusResponse, url: str, others: Sequence[RunsResponse] = ()
) -> Any:
    """The live view: the ranks, then the GPUs, problems in colour, fitted to the terminal.

    At any width every number shown is whole: columns that do not fit are dropped by
    priority and named in the caption; run, rank, status and anomalies are never dropped (a
    long run id loses its middle instead). Without GPU metrics (a CPU node, NVML failing) the
    GPU table is one line saying why. A hung run's merged view follows the ranks (with the
    ranks ``others``, the other exporters read, hold of it).
    """
    from rich.console import Group

    rows = rank_rows(runs, gpus)
    ids = [row["run"] for row in rows]
    for i in range(1, len(rows)):
        if ids[i] == ids[i - 1]:
            rows[i]["run"] = ""  # a run's id heads its first rank only
    styles: list[tuple[str, dict[str, str]]] = []
    for row in rows:
        style = {
            "crashed": "bold red",
            "failed": "bold red",
            "finished": "dim",
            "disconnected": "dim",
        }.get(row["status"], "")
        cell_styles: dict[str, str] = {}
        if row["anomalies"] != "ok":
            cell_styles["anomalies"] = "yellow"
        if row["loss"] == NONFINITE:
            cell_styles["loss"] = "bold red"
        styles.append((style, cell_styles))
    ranks = _FittedTable(
        printable(f"trainmon · {url}"),
        LIVE_RANK_COLUMNS,
        rows,
        styles,
        None if rows else "No trainer has connected yet.",
    )
    times = TimeTable(runs, SHORT_RUN)
    trends = sparkline.TerminalTrends(runs, SHORT_RUN)
    jobs = [_line(printable(line)) for run in runs.runs if (line := TERMINAL.job(run))]
    hangs = [
        _line(text, "bold red" if i == 0 or "SUSPECT" in text else "")
        for i, text in enumerate(hang_lines([runs, *others]))
    ]
    line = gpu_line(gpus)
    if line is not None:
        gpu = _line(line, "" if gpus.ok or not gpus.hint else "yellow")
        return Group(ranks, *jobs, times, trends, *hangs, gpu)
    grows = gpu_rows(gpus)
    gstyles: list[tuple[str, dict[str, str]]] = [
        ("bold red" if r["xids"] != "0" else ("yellow" if r["slowdown"] != "none" else ""), {})
        for r in grows
    ]
    gpu_table = _FittedTable("GPUs", LIVE_GPU_COLUMNS, grows, gstyles, None)
    return Group(ranks, *jobs, times, trends, *hangs, gpu_table)


def _parser(prog: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description="Runs, ranks and GPUs of a trainmon exporter in the terminal."
    )
    ap.add_argument(
        "--url",
        action="append",
        help=f"exporter address, HOST:PORT or http(s)://HOST:PORT (default {DEFAULT_URL}); "
        "again for each node of a multi-node job: a hung run's view merges their ranks",
    )
    ap.add_argument("--once", action="store_true", help="print one plain snapshot and exit")
    ap.add_argument("--interval", type=float, default=2.0, help="live refresh period (s)")
    ap.add_argument("--ca-file", help="PEM CA(s) that signed an https exporter's certificate")
    ap.add_argument("--user", help=f"basic auth user; the password from {PASSWORD_VARIABLE}")
    ap.add_argument("--password-file", help="read the basic auth password from this file")
    return ap


def _close(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean --once?)`` for a mistyped ``word`` close to one of ``choices``, or ``""``.

    :func:`difflib.get_close_matches` at ratio 0.6, as the exporter's own flags are checked.
    """
    close = difflib.get_close_matches(word.split("=", 1)[0], choices, 1, 0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def main(argv: Sequence[str] | None = None, prog: str = "trainmon status") -> int:
    """``trainmon status``; returns the exit code.

    2 when the exporter cannot be read, and for a flag it does not know (with the closest one
    it does, ``--onec``: ``did you mean --once?``).
    """
    parser = _parser(prog)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        hints = "".join(_close(u, flags) for u in unknown if u.startswith("-"))
        parser.print_usage(sys.stderr)
        print(f"{prog}: error: unrecognized arguments: {' '.join(unknown)}{hints}", file=sys.stderr)
        return 2
    try:
        urls = [normalise_url(u) for u in args.url or [DEFAULT_URL]]
        url, others = urls[0], urls[1:]
        how = access_from(args)
        runs, gpus = fetch(url, access=how)
        more = [fetch(u, access=how) for u in others]
    except StatusError as exc:
        print(f"trainmon status: {exc}", file=sys.stderr)
        return 2
    if args.once:
        sys.stdout.write(plain(runs, gpus, more))
        return 0
    from rich.live import Live

    view = rich_view(runs, gpus, url, [r for r, _ in more])
    with Live(view, refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(max(0.2, args.interval))
                try:
                    runs, gpus = fetch(url, access=how)
                    nodes = [fetch_runs(u, access=how) for u in others]
                except StatusError as exc:
                    live.console.print(str(exc), style="red", markup=False)
                    continue
                live.update(rich_view(runs, gpus, url, nodes))
        except KeyboardInterrupt:
            return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """The ``trainmon`` command: ``trainmon status ...``, ``--help``, ``--version``.

    Returns the exit code: 0 for ``--help``/``--version``, 2 for a missing or unknown command.
    """
    from trainmon_exporter import __version__

    ap = argparse.ArgumentParser(
        prog="trainmon",
        description="trainmon command line: views of a running trainmon exporter.",
    )
    ap.add_argument("--version", action="version", version=f"trainmon {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "status",
        help="runs, ranks and GPUs of an exporter in the terminal (live, or --once)",
        add_help=False,  # ``trainmon status --help`` is answered by the status parser
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] != "status":
        ap.print_usage(sys.stderr)
        print(
            f"trainmon: error: no command {argv[0]!r}{_close(argv[0], ['status'])}; the one "
            "command is trainmon status",
            file=sys.stderr,
        )
        return 2
    try:
        args, _ = ap.parse_known_args(argv[:1])
    except SystemExit as exc:  # --help / --version (0) or an unknown command (2)
        return int(exc.code or 0)
    if args.command != "status":
        ap.print_usage(sys.stderr)
        print("trainmon: error: a command is required (trainmon status)", file=sys.stderr)
        return 2
    try:
        return main(argv[1:])
    except SystemExit as exc:  # argparse: --help (0) or a bad flag (2)
        return int(exc.code or 0)
