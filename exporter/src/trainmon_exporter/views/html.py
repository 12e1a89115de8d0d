"""The status page at ``/``: runs, ranks and GPUs on one HTML page that refreshes every 5 s.

:func:`render_status` reads only its :class:`StatusPage`: the API's view model and the few
facts about the exporter itself that the page shows. Every string is escaped (run ids, names
and hostnames come from clients): control characters first
(:func:`~trainmon_exporter.views.cells.printable`), then HTML.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainmon_exporter import __version__
from trainmon_exporter.sampler import NO_DRIVER
from trainmon_exporter.state.rank import HISTORY_STEPS
from trainmon_exporter.views import hangs as hang_views
from trainmon_exporter.views import sparkline
from trainmon_exporter.views.api import GpusResponse, RankView, RunsResponse, RunView
from trainmon_exporter.views.cells import (
    PAGE,
    TIME_PARTS,
    mfu_reason,
    printable,
    rank_status,
    scale,
    stopped,
    time_part,
    time_shares,
    time_words,
)


@dataclass(frozen=True)
class StatusPage:
    """What the status page shows."""

    runs: RunsResponse
    gpus: GpusResponse
    socket: str
    """The ingest socket's path."""
    socket_problem: str | None
    """Why trainers cannot reach the socket (``None``: it listens)."""
    collectors: Mapping[str, bool]
    """Whether each collector succeeded in the last scrape (empty: not scraped yet)."""
    gpu_state: str | None
    """The NVML sampler's state (``sampler.STATES``); ``None`` when GPU sampling is off."""
    hangs: list[RunView] = field(default_factory=list)
    """The runs with hang evidence, each with its merged view (its peers' ranks merged in)."""
    peer_problems: list[str] = field(default_factory=list)
    """Status peers that could not be read, one line each."""


def _text(s: str) -> str:
    """A string from the API as page text: control characters escaped, then HTML-escaped."""
    return html.escape(printable(s))


def _spark(rank: RankView, series: str) -> str:
    """A sparkline cell: the SVG and the range it spans (empty before any step)."""
    t = rank.trend
    values = getattr(t, series)
    what = {"loss": "loss", "tokens_per_second": "tokens/s"}.get(series, series)
    marks = t.marks if series == "loss" else [m for m in t.marks if m.kind in sparkline.FLOW]
    drawn = sparkline.svg(values, marks, t.steps, what)
    if not drawn:
        return ""
    return f"{drawn}<div class='range'>{sparkline.range_text(values)}</div>"


def _goodput(rank: RankView, width: int = 90, height: int = 10) -> str:
    """The goodput cell: its figure, a bar of where the time went, then its sparkline.

    The bar is inline SVG, one part per colour (the key names them), each with its share as
    a tooltip, and every part in words as the bar's own tooltip and label; under them, one
    short line: the two largest badput kinds.
    """
    g = rank.goodput
    figure = _text(PAGE.percent(None if g is None else g.ratio))
    shares = time_shares(g)
    if not shares:
        return figure + _spark(rank, "goodput")
    parts, x = [], 0.0
    for part, share in shares:
        _, words, colour = time_part(part)
        w = share * width
        parts.append(
            f"<rect x='{x:.1f}' y='0' width='{w:.1f}' height='{height}' fill='{colour}'>"
            f"<title>{_text(words)}: {share * 100:.1f} %</title></rect>"
        )
        x += w
    every = _text(time_words(shares, PAGE.gap))
    badput = [(k, v) for k, v in shares if k not in ("productive", "uncheckpointed")]
    top = _text(time_words(badput[:2], PAGE.gap)) if badput else "no badput"
    return (
        f"{figure} <svg class='time' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img' aria-label='{every}' "
        f"xmlns='http://www.w3.org/2000/svg'><title>{every}</title>{''.join(parts)}</svg>"
        f"<div class='range'>{top}</div>{_spark(rank, 'goodput')}"
    )


def _rank_rows(page: StatusPage) -> str:
    e, c = _text, PAGE
    rows = []
    for run in page.runs.runs:
        for r in run.ranks:
            health = "; ".join(r.health) or "ok"
            if r.events:
                last = r.events[-1]
                times = f" x{last.count} to step {last.last_step}" if last.count > 1 else ""
                health += f" · last event: {last.kind} at step {last.step}{times}"
            status = rank_status(r)
            why = mfu_reason(r.mfu_unavailable_reason or "")[1] if r.mfu_ratio is None else ""
            mfu_title = f" title='no MFU: {e(why)}'" if why and not stopped(r) else ""
            rows.append(
                "<tr>"
                f"<td>{e(run.label)}</td><td>{r.rank}/{r.world_size}</td>"
                f"<td>{e(r.hostname)}</td>"
                f"<td class='{e(status)}'>{e(status)}</td>"
                f"<td class='health'>{e(health)}</td>"
                f"<td>{'' if r.step is None else r.step}</td>"
                f"<td>{c.logged(r.values, 'loss', '.4g')}</td>"
                f"<td class='spark'>{_spark(r, 'loss')}</td>"
                f"<td class='spark'>{_goodput(r)}</td>"
                f"<td>{c.throughput(r, ',.0f')}</td>"
                f"<td class='spark'>{_spark(r, 'tokens_per_second')}</td>"
                f"<td{mfu_title}>{e(c.mfu(r))}</td>"
                f"<td>{c.logged(r.values, 'lr', '.3g')}</td>"
                f"<td>{c.logged(r.values, 'grad_norm', '.3g')}</td>"
                f"<td>{c.missing if r.gpu is None else r.gpu}</td>"
                f"<td>{c.number(scale(r.step_time_mean_seconds, 1e3), '.1f')}</td>"
                f"<td>{c.number(scale(r.client_overhead_ratio, 100), '.3f')}</td>"
                f"<td>{c.number(r.seconds_since_last_step, '.1f')}</td>"
                "</tr>"
            )
    return "\n".join(rows) or "<tr><td colspan='18'>No trainer has connected yet.</td></tr>"


def _job_lines(page: StatusPage) -> str:
    """Each run's job-wide goodput (docs/goodput.md#the-whole-job), one paragraph a run."""
    lines = (PAGE.job(run) for run in page.runs.runs)
    return "\n".join(f"<p class='job'>{_text(line)}</p>" for line in lines if line)


def _gpu_rows(gpus: GpusResponse) -> str:
    e, c = _text, PAGE
    return "".join(
        "<tr>"
        f"<td>{g.index}</td><td>{e(g.name)}</td><td>{e(g.uuid)}</td>"
        f"<td>{c.number(scale(g.utilization_ratio, 100), '.0f')}</td>"
        f"<td>{c.number(scale(g.tensor_active_ratio, 100), '.0f')}</td>"
        f"<td>{c.gib(g.memory_used_bytes)} / {c.gib(g.memory_size_bytes)}</td>"
        f"<td>{c.number(g.power_usage_watts, '.0f')}</td>"
        f"<td>{c.number(g.temperature_celsius, '.0f')}</td>"
        f"<td>{c.number(scale(g.sm_clock_hertz, 1e-6), '.0f')}</td>"
        f"<td>{e(', '.join(g.slowdown_reasons)) or 'none'}</td>"
        f"<td>{g.xid_errors}</td>"
        "</tr>"
        for g in gpus.gpus
    )


def _gpu_head(page: StatusPage) -> str:
    e, gpus = _text, page.gpus
    if gpus.ok:
        lost = f" · {gpus.lost_total} lost" if gpus.lost_total else ""
        return (
            f"<p>NVML driver {e(gpus.driver_version)}: {len(gpus.gpus)} GPU(s){lost}, "
            f"sampled in {gpus.sample_seconds * 1e3:.1f} ms.</p>"
        )
    if page.gpu_state is None:
        return "<p>GPU sampling is turned off (collectors gpu and rank_gpu).</p>"
    if page.gpu_state == NO_DRIVER:
        return (
            f"<p>No GPU metrics: no NVIDIA driver on this node ({e(gpus.error)}). Training "
            "metrics are unaffected.</p>"
        )
    hint = f" Hint: {e(gpus.hint)}" if gpus.hint else ""
    return f"<p class='crashed'>No GPU metrics: {e(gpus.error)}.</p><p>{hint}</p>"


def _scrape_words(collectors: Mapping[str, bool]) -> str:
    """How the last scrape of ``/metrics`` went, in words (HTML-escaped)."""
    if not collectors:
        return "metrics: not collected yet (Prometheus has not scraped /metrics)"
    failed = [k for k, ok in collectors.items() if not ok]
    if not failed:
        return "metrics: the last scrape was complete"
    names = ", ".join(_text(k) for k in failed)
    return (
        f"<span class='crashed'>metrics: the last scrape lacked the {names} series "
        "(their collectors failed; see the exporter's log)</span>"
    )


_FRAMES_SHOWN = 40
"""Frames of a stack the page shows (innermost first); the JSON API has them all."""


def _frames(frames: list[Any], shown: int = _FRAMES_SHOWN) -> str:
    """A stack as preformatted text, innermost first; library frames dimmed."""
    e = _text
    lines = []
    for f in list(reversed(frames))[:shown]:
        text = f"{e(f.function)} ({e(f.file)}:{f.line})"
        lines.append(text if f.user else f"<span class='lib'>{text}</span>")
    if len(frames) > shown:
        lines.append(f"… {len(frames) - shown} outer frames in /api/v1/runs")
    return "\n".join(lines)


def _rank_hang(r: RankView) -> str:
    """One rank's capture: its status, notes, GPU, process groups, other threads."""
    e, h = _text, r.hang
    assert h is not None
    parts = [f"<h4>rank {r.rank} · {e(h.status.replace('_', ' '))}"]
    if h.step is not None:
        parts.append(f" · last step {h.step}")
    parts.append("</h4>")
    gpu = hang_views.gpu_words(r)
    if gpu:
        parts.append(f"<p>GPU when asked: {e(gpu)}</p>")
    for note in h.notes:
        parts.append(f"<p class='note'>{e(note)}</p>")
    if h.groups:
        rows = "".join(
            f"<tr><td>{e(g.id)}</td><td>{e(g.name)}</td><td>{g.enqueued}</td>"
            f"<td>{'' if g.started < 0 else g.started}</td><td>{g.completed}</td>"
            f"<td>{'' if g.pending is None else e(g.pending.op)}</td>"
            f"<td>{'' if g.pending is None else g.pending.seq}</td>"
            f"<td>{'' if g.pending is None else e(str(g.pending.sizes))}</td></tr>"
            for g in h.groups
        )
        parts.append(
            "<table class='groups'><tr><th>group</th><th>name</th><th>enqueued</th>"
            "<th>started</th><th>completed</th><th>pending</th><th>seq</th><th>sizes</th></tr>"
            f"{rows}</table>"
        )
    for t in h.threads:
        cpu = "" if t.cpu is None else f", CPU {t.cpu:.0%}"
        what = "training thread" if t.training else "thread"
        parts.append(
            f"<details><summary>{what} {e(t.name)} ({e(t.state or '?')}{cpu})</summary>"
            f"<pre>{_frames(t.frames)}</pre></details>"
        )
    if h.native:
        parts.append(
            f"<details><summary>native stacks (py-spy)</summary><pre>{e(h.native)}</pre></details>"
        )
    return "".join(parts)


def _hang_sections(page: StatusPage) -> str:
    """One merged view per run with hang evidence: each distinct stack once, suspects first."""
    e = _text
    out = []
    for run in page.hangs:
        v = run.hang
        if v is None:
            continue
        rows = []
        for st in v.stacks:
            ranks = ", ".join(str(r) for r in st.ranks)
            where = "" if st.frame is None else e(st.frame)
            rows.append(
                f"<tr class='{'suspect' if st.suspect else ''}'>"
                f"<td class='headline'>{e(st.headline)}"
                f"{' · <b>suspect</b>' if st.suspect else ''}</td>"
                f"<td>{ranks}</td><td>{where}</td><td>{e(st.collective)}</td>"
                f"<td class='stack'><details{' open' if st.suspect else ''}><summary>"
                f"{len(st.frames)} frames, innermost first</summary>"
                f"<pre>{_frames(st.frames)}</pre></details></td></tr>"
            )
        ranks = "".join(_rank_hang(r) for r in run.ranks if r.hang is not None)
        head = e(hang_views.summary(run, page.runs.time))
        out.append(
            f"<h2 class='hang {e(v.state)}'>Hang · {head}</h2>"
            "<table class='stacks'><thead><tr><th>stack</th><th>ranks</th>"
            "<th>innermost frame in user code</th><th>waiting in</th><th>frames</th></tr>"
            f"</thead><tbody>{''.join(rows)}</tbody></table>"
            f"<details><summary>each rank's capture</summary>{ranks}</details>"
        )
    for problem in page.peer_problems:
        out.append(f"<p class='note'>{e(problem)}</p>")
    return "\n".join(out)


def _legend() -> str:
    """What the sparklines show and what their marks mean."""
    marks = ", ".join(
        f"<span style='color:{colour}'>{'N ' if kind == 'nonfinite' else ''}|</span> {words}"
        for kind, (_, words, colour) in sparkline.MARKS.items()
    )
    parts = ", ".join(
        f"<span style='color:{colour}'>■</span> {words}" for _, words, colour in TIME_PARTS.values()
    )
    return (
        f"<p class='key'>Sparklines: each rank's last {HISTORY_STEPS} logged steps, oldest on "
        f"the left, scaled to the range printed under them; the green dot is the latest. "
        f"Marks: {marks}. Hover a mark for its step.</p>"
        f"<p class='key'>Where the time went, since each rank's <code>init()</code> "
        f"(<a href='/api/v1/runs'>goodput</a> in the API): {parts}.</p>"
    )


def render_status(page: StatusPage) -> str:
    """HTML for ``/``."""
    e = _text
    collectors = _scrape_words(page.collectors)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>trainmon exporter</title>
<style>
body{{font-family:system-ui,sans-serif;margin:1.5em;color:#222}}
table{{border-collapse:collapse}}
td,th{{padding:.3em .6em;border-bottom:1px solid #ddd;text-align:right;vertical-align:middle}}
td{{white-space:nowrap}} td:first-child,td:nth-child(3),td:last-child{{white-space:normal}}
table.ranks td.health{{white-space:normal;text-align:left;min-width:12em;max-width:20em}}
table.ranks th.health{{text-align:left}}
table.ranks td:last-child,table.ranks th:last-child{{white-space:nowrap;text-align:right}}
td:first-child,th:first-child,td:nth-child(3),td:nth-child(4),td:last-child,th:last-child{{text-align:left}}
.crashed,.failed{{color:#b00;font-weight:bold}} .running{{color:#070}} .finished{{color:#555}}
.disconnected{{color:#555}} td.spark{{padding:.2em .4em;text-align:left}}
svg.spark{{display:block}} svg.time{{display:inline-block;vertical-align:middle}}
.range{{font-size:75%;color:#555}}
.key span{{font-weight:bold;padding:0 .2em}}
h2.hang.hung{{color:#b00}} table.stacks td{{text-align:left;white-space:normal;vertical-align:top}}
tr.suspect td.headline{{color:#b00}} pre{{margin:0;font-size:85%}} .lib{{color:#777}}
.note{{color:#960}} table.groups td{{text-align:right}}
</style></head><body>
<h1>trainmon exporter {e(__version__)}</h1>
<p>Ingest socket <code>{e(page.socket)}</code>:
{e(page.socket_problem or "listening")} ·
{collectors} ·
<a href="/metrics">/metrics</a> · <a href="/api/v1/runs">/api/v1/runs</a> ·
<a href="/openapi.json">API schema (OpenAPI)</a></p>
{_hang_sections(page)}
{_legend()}
{_job_lines(page)}
<table class='ranks'><thead><tr><th>run</th><th>rank</th><th>host</th><th>status</th>
<th class='health'>health</th><th>step</th>
<th>loss</th><th>loss, recent steps</th>
<th>goodput: where the time went, recent steps</th><th>tokens/s</th>
<th>tokens/s, recent steps</th><th>MFU</th><th>lr</th><th>grad norm</th>
<th>GPU</th>
<th>step ms</th>
<th>client overhead %</th><th>s since step</th></tr></thead>
<tbody>
{_rank_rows(page)}
</tbody></table>
<h2>GPUs</h2>
{_gpu_head(page)}
<table><thead><tr><th>gpu</th><th>name</th><th>uuid</th><th>util %</th><th>tensor %</th>
<th>memory GiB</th><th>power W</th><th>temp °C</th><th>SM MHz</th><th>slowdown</th>
<th>XIDs</th></tr></thead>
<tbody>
{_gpu_rows(page.gpus)}
</tbody></table></body></html>"""
