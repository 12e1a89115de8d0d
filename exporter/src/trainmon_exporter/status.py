"""``trainmon status``: runs, ranks and GPUs in a terminal, for a node with no Grafana.

    trainmon status [--url http://127.0.0.1:9478] [--interval 2]   # live view (rich), Ctrl-C
    trainmon status --once                                         # one plain snapshot

Reads ``/api/v1/runs`` and ``/api/v1/gpus`` of a running exporter (also reachable as
``trainmon-exporter status``). ``--once`` prints whitespace-separated columns with a header
line, ``-`` for a missing value and no colour, so scripts can parse it; rows are sorted by run
and rank, then GPUs by index.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from trainmon_exporter.settings import DEFAULT_PORT

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"

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


class StatusError(RuntimeError):
    """The exporter could not be read (one line for the user)."""


def fetch(url: str, timeout: float = 5.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(runs, gpus)``: the bodies of ``/api/v1/runs`` and ``/api/v1/gpus``.

    Raises:
        StatusError: the exporter is unreachable or answered with an error.
    """
    out = []
    for path in ("/api/v1/runs", "/api/v1/gpus"):
        try:
            with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as r:
                out.append(json.loads(r.read()))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise StatusError(f"cannot read {url}{path}: {reason}") from None
    return out[0], out[1]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _anomalies(r: dict[str, Any]) -> str:
    parts = list(r.get("health") or [])
    events = r.get("events") or []
    if events:
        last = events[-1]
        parts.append(f"last event {last['kind']} at step {last['step']}")
    return "; ".join(parts) or "ok"


def rank_rows(runs: dict[str, Any], gpus: dict[str, Any]) -> list[dict[str, str]]:
    """One row per rank, every value already formatted (``-`` when missing)."""
    by_index = {g["index"]: g for g in gpus.get("gpus", [])}
    rows = []
    for run in runs.get("runs", []):
        for r in run["ranks"]:
            g = by_index.get(r.get("gpu"))
            mem = None
            if g and g.get("memory_used_bytes") is not None and g.get("memory_size_bytes"):
                mem = g["memory_used_bytes"] / g["memory_size_bytes"]
            mfu = _pct(r.get("mfu_ratio"))
            if r.get("mfu_ratio") is None and r.get("mfu_unavailable_reason"):
                mfu = f"-({r['mfu_unavailable_reason']})"
            values = r.get("values") or {}
            loss = (
                "NaN/Inf"
                if "loss" in values and values["loss"] is None
                else _num(values.get("loss"), ".4g")
            )
            rows.append(
                {
                    "run": run["run"],
                    "rank": f"{r['rank']}/{r['world_size']}",
                    "host": r["hostname"] or "-",
                    "status": r["status"],
                    "step": "-" if r["step"] is None else str(r["step"]),
                    "loss": loss,
                    "loss_ema": _num(r.get("loss_ema"), ".4g"),
                    "tokens_per_s": _num(r.get("tokens_per_second"), ".0f"),
                    "mfu": mfu,
                    "gpu": "-" if r.get("gpu") is None else str(r["gpu"]),
                    "gpu_util": _pct(g.get("utilization_ratio")) if g else "-",
                    "gpu_mem": _pct(mem),
                    "anomalies": _anomalies(r),
                }
            )
    return rows


def gpu_rows(gpus: dict[str, Any]) -> list[dict[str, str]]:
    """One row per GPU of the last NVML sample."""
    rows = []
    for g in sorted(gpus.get("gpus", []), key=lambda g: g["index"]):
        gib = 2.0**30
        rows.append(
            {
                "gpu": str(g["index"]),
                "name": g["name"],
                "util": _pct(g.get("utilization_ratio")),
                "tensor": _pct(g.get("tensor_active_ratio")),
                "mem_used_gib": _num(
                    None if g.get("memory_used_bytes") is None else g["memory_used_bytes"] / gib,
                    ".1f",
                ),
                "mem_total_gib": _num(
                    None if g.get("memory_size_bytes") is None else g["memory_size_bytes"] / gib,
                    ".1f",
                ),
                "power_w": _num(g.get("power_usage_watts"), ".0f"),
                "temp_c": _num(g.get("temperature_celsius"), ".0f"),
                "slowdown": ",".join(g.get("slowdown_reasons") or []) or "none",
                "xids": str(g.get("xid_errors", 0)),
            }
        )
    return rows


def plain(runs: dict[str, Any], gpus: dict[str, Any]) -> str:
    """The ``--once`` snapshot: a ranks section, then a GPUs section.

    Columns are separated by two spaces or more (values never contain two spaces); ``-``
    stands for a missing value.
    """

    def table(columns: Sequence[str], rows: list[dict[str, str]]) -> list[str]:
        cells = [list(columns)] + [[row[c].replace("  ", " ") for c in columns] for row in rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
        return [
            "  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip()
            for line in cells
        ]

    lines = ["# ranks", *table(RANK_COLUMNS, rank_rows(runs, gpus))]
    lines.append("")
    if gpus.get("ok"):
        lines.append(
            f"# gpus (driver {gpus.get('driver_version') or '?'}, {gpus.get('lost_total', 0)} lost)"
        )
        lines += table(GPU_COLUMNS, gpu_rows(gpus))
    else:
        lines.append(f"# gpus: none ({gpus.get('error') or 'GPU sampling off'})")
    return "\n".join(lines) + "\n"


def rich_view(runs: dict[str, Any], gpus: dict[str, Any], url: str) -> Any:
    """The live view: two rich tables, problems in colour."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    ranks = Table(title=f"trainmon · {url}", expand=True)
    for c in RANK_COLUMNS:
        ranks.add_column(c.replace("_", " "), overflow="fold", no_wrap=c != "anomalies")
    for row in rank_rows(runs, gpus):
        style = {"crashed": "bold red", "failed": "bold red", "finished": "dim"}.get(
            row["status"], ""
        )
        cells = [Text(row[c]) for c in RANK_COLUMNS]
        if row["anomalies"] != "ok":
            cells[-1].stylize("yellow")
        if row["loss"] == "NaN/Inf":
            cells[RANK_COLUMNS.index("loss")].stylize("bold red")
        ranks.add_row(*cells, style=style)
    if not ranks.rows:
        ranks.caption = "No trainer has connected yet."
    gpu_table = Table(title="GPUs", expand=True)
    for c in GPU_COLUMNS:
        gpu_table.add_column(c.replace("_", " "))
    for row in gpu_rows(gpus):
        style = (
            "bold red" if row["xids"] != "0" else ("yellow" if row["slowdown"] != "none" else "")
        )
        gpu_table.add_row(*(row[c] for c in GPU_COLUMNS), style=style)
    if not gpus.get("ok"):
        hint = f" Hint: {gpus['hint']}" if gpus.get("hint") else ""
        gpu_table.caption = f"No GPU metrics: {gpus.get('error')}.{hint}"
    return Group(ranks, gpu_table)


def main(argv: Sequence[str] | None = None) -> int:
    """``trainmon status``; returns the exit code (2 when the exporter cannot be read)."""
    ap = argparse.ArgumentParser(prog="trainmon status", description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=DEFAULT_URL, help=f"exporter address (default {DEFAULT_URL})")
    ap.add_argument("--once", action="store_true", help="print one plain snapshot and exit")
    ap.add_argument("--interval", type=float, default=2.0, help="live refresh period (s)")
    args = ap.parse_args(argv)
    try:
        runs, gpus = fetch(args.url)
    except StatusError as exc:
        print(f"trainmon status: {exc}", file=sys.stderr)
        return 2
    if args.once:
        sys.stdout.write(plain(runs, gpus))
        return 0
    from rich.live import Live

    with Live(rich_view(runs, gpus, args.url), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(max(0.2, args.interval))
                try:
                    runs, gpus = fetch(args.url)
                except StatusError as exc:
                    live.console.print(f"[red]{exc}[/red]")
                    continue
                live.update(rich_view(runs, gpus, args.url))
        except KeyboardInterrupt:
            return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """The ``trainmon`` command: ``trainmon status ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "status":
        print("usage: trainmon status [--url URL] [--once] [--interval S]", file=sys.stderr)
        return 2
    return main(argv[1:])
