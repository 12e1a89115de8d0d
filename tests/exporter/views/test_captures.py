"""What a person sees, captured: ``trainmon status`` at 80 and 120 columns and the status page
in headless Chromium, for a run with a generated id whose four ranks had a loss spike, a NaN
with a throughput drop, a checkpoint rollback and a hang (``tests/helpers/trends.py``).

The terminal captures are golden files compared byte for byte; the screenshot is rewritten
with them (``TRAINMON_UPDATE_GOLDEN=1``) for review, and checked here for what must be seen in
it. Look at the files after a change to a view.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from trainmon_exporter.sampler import NO_DRIVER, SAMPLING
from trainmon_exporter.views import sparkline, terminal
from trainmon_exporter.views.api import GpusResponse, RunsResponse
from trainmon_exporter.views.html import StatusPage, render_status

from ...helpers import png, trends
from ...helpers import views as v

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
UPDATE = os.environ.get("TRAINMON_UPDATE_GOLDEN") == "1"


def cases() -> dict[int, GpusResponse]:
    """The widths captured: a CPU node at 80 columns, four H100s (one with an XID) at 120."""
    return {
        80: v.no_gpus("NVML Shared Library Not Found", "install the NVIDIA driver"),
        120: v.gpus(*[v.gpu(i, xid_errors=1 if i == 1 else 0) for i in range(4)]),
    }


def screen(width: int) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(terminal.rich_view(trends.runs(), cases()[width], "http://127.0.0.1:9478"))
    return console.export_text()


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with TRAINMON_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} changed (TRAINMON_UPDATE_GOLDEN=1 to accept)"


@pytest.mark.parametrize("width", [80, 120])
def test_the_terminal_at_80_and_120_columns(width: int) -> None:
    text = screen(width)
    check_golden(f"status.terminal.{width}.txt", text)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    # Every rank has its three sparklines, and each mark letter sits under its sparkline.
    trends_at = next(i for i, line in enumerate(lines) if "recent steps, oldest left" in line)
    spark_rows = [line for line in lines[trends_at:] if any(b in line for b in sparkline.BLOCKS)]
    assert len(spark_rows) == 4 and all(line.count("│") == 5 for line in spark_rows)  # one run
    marks_line = "\n".join(lines[lines.index(spark_rows[0]) :])
    for letter in "SNRH":
        assert f" {letter} " in marks_line or f" {letter}\n" in marks_line, letter
    assert "marks: N NaN/Inf · S loss spike · H hang · R restart or rollback" in " ".join(
        text.split()
    )
    # Where each rank's time went, above the sparklines: its goodput, its bar, in words.
    times = " ".join(re.sub("[│┃]", " ", "\n".join(lines[:trends_at])).split())
    for goodput, bar, words in [
        ("86.2%", "█+▓+d+c+s+", "data loading 7.5% · checkpoint save 3.1% · start-up 3.1%"),
        ("71.8%", "█+▓+w+d+c+s+", "wasted progress 14.4%"),
        ("35.9%", "█+▓+h+d", "hang 58.4%"),
    ]:
        assert re.search(rf"{re.escape(goodput)} {bar} productive", times), (goodput, times)
        assert words in times
    # The generated run id is shortened in the middle, and health is never hidden.
    assert all(f" {n} " in text for n in ("loss", "tokens/s", "goodput"))
    assert "pretrain_g…1523-ab12" in text and "anomalies" in text
    assert "nonfinite_loss" in text


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def screenshot(page: StatusPage, out: Path) -> tuple[int, int, list[bytes]]:
    browser = chromium()
    if browser is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium)")
    html = out.with_suffix(".html")
    html.write_text(render_status(page))
    done = subprocess.run(
        [
            *[browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"],
            *[f"--user-data-dir={out.parent / 'profile'}", "--window-size=1920,640"],
            *[f"--screenshot={out}", html.as_uri()],
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and out.exists(), done.stderr[-2000:]
    return png.read(out)


def rgb(colour: str) -> tuple[int, int, int]:
    """``#c00`` or ``#0060c0`` as (red, green, blue)."""
    h = colour.lstrip("#")
    h = "".join(ch * 2 for ch in h) if len(h) == 3 else h
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def page(runs: RunsResponse) -> StatusPage:
    return StatusPage(
        runs=runs,
        gpus=cases()[120],
        socket="/run/trainmon/trainmon.sock",
        socket_problem=None,
        collectors={"training": True, "gpu": True},
        gpu_state=SAMPLING,
    )


@pytest.mark.slow  # three Chromium runs
def test_the_status_page_in_headless_chromium(tmp_path: Path) -> None:
    shot = tmp_path / "status.page.png"
    width, height, rows = screenshot(page(trends.runs()), shot)
    if UPDATE:
        shutil.copyfile(shot, GOLDEN / "status.page.png")
    assert (width, height) == (1920, 640)
    # The same ranks without their history: what the legend alone paints in each colour.
    bare = trends.runs()
    for r in bare.runs[0].ranks:
        r.trend.marks = []
    _, _, bare_rows = screenshot(page(bare), tmp_path / "bare.png")
    for kind, (_, words, colour) in sparkline.MARKS.items():
        marked, legend = png.count(rows, rgb(colour), 12), png.count(bare_rows, rgb(colour), 12)
        assert marked >= legend + 10, (kind, words, marked, legend)  # a 2-pixel line at least
    # The sparklines' lines are drawn: far more dark grey than the page without them.
    no_lines = trends.runs()
    for r in no_lines.runs[0].ranks:
        r.trend.loss = [None] * len(r.trend.loss)
        r.trend.tokens_per_second = [None] * len(r.trend.tokens_per_second)
        r.trend.goodput = [None] * len(r.trend.goodput)
    _, _, empty_rows = screenshot(page(no_lines), tmp_path / "empty.png")
    assert png.count(rows, (0x33, 0x33, 0x33), 30) > png.count(empty_rows, (0x33, 0x33, 0x33), 30)


def test_a_node_without_gpus_says_so_on_the_page() -> None:
    html = render_status(
        StatusPage(
            runs=trends.runs(),
            gpus=cases()[80],
            socket="/run/trainmon/trainmon.sock",
            socket_problem=None,
            collectors={},
            gpu_state=NO_DRIVER,
        )
    )
    assert "no NVIDIA driver on this node" in html and html.count("<svg class='spark'") == 12
    # Each rank's goodput sparkline, labelled, over the same steps as its loss.
    assert html.count("aria-label='goodput, steps 3 to 239, from 0.251 to 0.868'") == 2
