"""The status page from a hand-built view model: cells, escaping and the GPU section."""

from __future__ import annotations

import re
from typing import Any

import pytest

from trainmon_exporter.sampler import FAILED, NO_DRIVER, SAMPLING
from trainmon_exporter.views.cells import TIME_PARTS
from trainmon_exporter.views.html import StatusPage, render_status

from ...helpers import views as v


def page(**kw: Any) -> StatusPage:
    fields: dict[str, Any] = {
        "runs": v.runs(v.rank(0)),
        "gpus": v.gpus(v.gpu(0)),
        "socket": "/run/trainmon/trainmon.sock",
        "socket_problem": None,
        "collectors": {"training": True, "gpu": True},
        "gpu_state": SAMPLING,
    }
    return StatusPage(**(fields | kw))


GOODPUT = "91.2 % data loading 4.6 % · start-up 2.5 %"
"""The goodput cell of the rank ``tests/helpers/views.py`` builds, as its text reads: the
figure, then (under its bar) the two largest badput kinds."""


def cells(html: str) -> list[list[str]]:
    """The body rows of every table, as lists of cell texts (tooltips and tags left out)."""

    def text(cell: str) -> str:
        return " ".join(re.sub(r"<[^>]+>", " ", re.sub(r"<title>.*?</title>", "", cell)).split())

    rows = re.findall(r"<tr>(.*?)</tr>", html)
    return [[text(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)] for row in rows]


def test_a_rank_row_shows_every_cell() -> None:
    rank = v.rank(
        3,
        values={"loss": None, "lr": 3e-4, "grad_norm": 1.25},
        events=[v.event("loss_spike", 100, count=3, last_step=120)],
        health=["loss spike"],
    )
    rows = cells(render_status(page(runs=v.runs(rank))))
    assert rows[0] == [
        *["gpt2-medium-finetune", "3/8", "gpu-node-10.cluster.example.org", "running"],
        "loss spike · last event: loss_spike at step 100 x3 to step 120",  # health, never cut off
        *["1499", "NaN/Inf", "", GOODPUT, "123,456", "", "41.7 %", "0.0003", "1.25"],
        *["3", "812.5", "0.123", "0.5"],
    ]


def test_missing_values_are_dashes_and_mfu_says_why() -> None:
    rank = v.rank(
        0,
        step=None,
        values={},
        tokens_per_second=None,
        mfu_ratio=None,
        mfu_unavailable_reason="unknown_gpu_model",
        gpu=None,
        step_time_mean_seconds=None,
        client_overhead_ratio=None,
        seconds_since_last_step=None,
    )
    row = cells(render_status(page(runs=v.runs(rank))))[0]
    assert row[4:] == [
        *["ok", "", "–", "", GOODPUT, "–", "", "– (GPU peak unknown)", "–", "–"],
        *["–", "–", "–", "–"],
    ]


def test_goodput_shows_where_the_time_went_right_after_the_loss() -> None:
    """The figure, a bar of every part (a tooltip each, and all in words as the bar's own)
    and the largest badput kinds, before throughput, MFU, lr and grad norm: a window too
    narrow for the whole table cuts those off first, never the goodput (docs/status.md). It
    used to come after them all, cut off below about 1,700 pixels, as one figure and the
    largest badput."""
    html = render_status(page())
    heads = re.findall(r"<th[^>]*>(.*?)</th>", html.split("<tbody>")[0])
    assert heads.index("goodput: where the time went, recent steps") == 8
    assert heads[9:12] == ["tokens/s", "tokens/s, recent steps", "MFU"]
    bar = re.search(r"<svg class='time'.*?</svg>", html, re.S)
    assert bar is not None
    every = (
        "productive 83.3 % · uncheckpointed 7.9 % · data loading 4.6 % · start-up 2.5 % · "
        "checkpoint save 1.7 %"
    )
    tips = re.findall(r"<title>(.*?)</title>", bar[0])
    assert tips == [
        *[every, "productive: 83.3 %", "uncheckpointed: 7.9 %", "data loading: 4.6 %"],
        *["start-up: 2.5 %", "checkpoint save: 1.7 %"],
    ]
    assert f"aria-label='{every}'" in bar[0]
    widths = [float(w) for w in re.findall(r"width='([\d.]+)' height='10' fill", bar[0])]
    assert sum(widths) == pytest.approx(90, abs=0.5)  # the parts fill the bar
    assert all(f"■</span> {words}" in html for _, words, _ in TIME_PARTS.values())  # the key


def test_client_text_is_escaped() -> None:
    rank = v.rank(0, hostname="<b>host</b>", status="running")
    html = render_status(page(runs=v.runs(rank, run="<script>alert(1)</script>")))
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;b&gt;host&lt;/b&gt;" in html


def test_no_rank_yet() -> None:
    assert "No trainer has connected yet." in render_status(page(runs=v.runs()))


def test_a_gpu_row_and_the_nvml_line() -> None:
    g = v.gpu(1, slowdown_reasons=["hw_slowdown", "sw_thermal_slowdown"], xid_errors=2)
    html = render_status(page(runs=v.runs(), gpus=v.gpus(g, lost_total=1)))
    assert cells(html)[1] == [
        *["1", "NVIDIA H100 80GB HBM3", "GPU-1", "93", "61", "71.0 / 80.0", "612", "67"],
        *["1980", "hw_slowdown, sw_thermal_slowdown", "2"],
    ]
    assert "<p>NVML driver 550.54.15: 1 GPU(s) · 1 lost, sampled in 4.2 ms.</p>" in html


def test_why_there_are_no_gpu_metrics() -> None:
    off = render_status(page(gpus=v.no_gpus("GPU sampling has not run yet"), gpu_state=None))
    assert "GPU sampling is turned off (collectors gpu and rank_gpu)." in off
    none = render_status(page(gpus=v.no_gpus("libnvidia-ml.so.1: not found"), gpu_state=NO_DRIVER))
    assert "no NVIDIA driver on this node (libnvidia-ml.so.1: not found)" in none
    assert "class='crashed'" not in none  # a node without GPUs is not a problem
    failed = render_status(
        page(gpus=v.no_gpus("Insufficient <perm>", "run as root"), gpu_state=FAILED)
    )
    assert "<p class='crashed'>No GPU metrics: Insufficient &lt;perm&gt;.</p>" in failed
    assert "<p> Hint: run as root</p>" in failed


def test_the_header_line_says_how_the_socket_and_the_last_scrape_are_in_words() -> None:
    html = render_status(page(collectors={"training": True, "gpu": True}))
    assert "<code>/run/trainmon/trainmon.sock</code>:\nlistening ·" in html
    assert "metrics: the last scrape was complete ·" in html
    html = render_status(page(collectors={"training": True, "gpu": False, "rank_gpu": False}))
    assert "metrics: the last scrape lacked the gpu, rank_gpu series" in html
    html = render_status(page(collectors={}, socket_problem="socket file was replaced"))
    assert "socket file was replaced ·" in html
    assert "metrics: not collected yet (Prometheus has not scraped /metrics)" in html
    assert "not scraped yet" not in html and "collectors:" not in html


def test_mfu_says_why_in_words_with_the_explanation_on_hover() -> None:
    rank = v.rank(0, mfu_ratio=None, mfu_unavailable_reason="no_gpu_uuid")
    html = render_status(page(runs=v.runs(rank)))
    assert "(no_gpu_uuid)" not in html
    assert (
        "<td title='no MFU: the trainer reported no CUDA device (a CPU run)'>– (no GPU)</td>"
        in (html)
    )


@pytest.mark.parametrize(
    ("status", "up", "shown"),
    [
        ("crashed", False, "crashed"),
        ("finished", True, "finished"),
        ("running", False, "disconnected"),
    ],
)
def test_a_rank_that_no_longer_runs_shows_no_throughput_and_says_why(
    status: str, up: bool, shown: str
) -> None:
    rank = v.rank(0, status=status, up=up)  # the API's last figure, as an older exporter sent
    row = cells(render_status(page(runs=v.runs(rank))))[0]
    assert row[3] == shown and row[9] == "–" and row[11] == "–"  # tokens/s and MFU


def test_no_control_character_from_the_api_reaches_the_page() -> None:
    h = v.HOSTILE
    rank = v.rank(0, hostname=h, status=h, health=[h], events=[v.event(h, 12)])
    gpus = v.gpus(v.gpu(0, name=h, uuid=h, slowdown_reasons=[h]), driver_version=h)
    for g, state in ((gpus, SAMPLING), (v.no_gpus(h, h), FAILED), (v.no_gpus(h), NO_DRIVER)):
        html = render_status(page(runs=v.runs(rank, run=h), gpus=g, gpu_state=state))
        assert not v.controls(html), html
        assert "a\\x1b[31mred" in html
