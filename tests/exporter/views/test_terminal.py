"""``trainmon status`` from hand-built view models: ``--once`` and the live view at ordinary
terminal widths (numbers are never cut)."""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from trainmon_exporter.views import terminal
from trainmon_exporter.views.api import GpusResponse, RunsResponse
from trainmon_exporter.views.cells import shorten_middle, time_shares, time_words

from ...helpers import views as v

# A number as the view prints it: 1499, 3/8, 0.2345, 41.7%, 1.2e+05.
NUMBER = re.compile(r"\d+(?:[./]\d+)*(?:e[-+]\d+)?%?")


def api_bodies() -> tuple[RunsResponse, GpusResponse]:
    """Three ranks (running, crashed with a NaN loss, finished) and their three GPUs."""
    ranks = [
        v.rank(
            r,
            status=["running", "crashed", "finished"][r],
            step=1499 + 1000 * r,
            values={"loss": None if r == 1 else 2.3456 + r},
            tokens_per_second=123456.0 + r,
            health=["nonfinite_loss"] if r == 1 else [],
            events=[v.event("loss_spike", 1377)] if r == 1 else [],
        )
        for r in range(3)
    ]
    gpus = [
        v.gpu(
            i,
            slowdown_reasons=["hw_thermal_slowdown"] if i == 1 else [],
            xid_errors=79 if i == 1 else 0,
        )
        for i in range(3)
    ]
    return v.runs(*ranks), v.gpus(*gpus)


def render(width: int) -> str:
    runs, gpus = api_bodies()
    console = Console(record=True, width=width, color_system=None)
    console.print(terminal.rich_view(runs, gpus, "http://127.0.0.1:9478"))
    return console.export_text()


def source_numbers() -> set[str]:
    """Every number in every formatted value, header and title the view may show."""
    runs, gpus = api_bodies()
    texts = [*terminal.rank_rows(runs, gpus), *terminal.gpu_rows(gpus)]
    found = {n for row in texts for v in row.values() for n in NUMBER.findall(v)}
    shares = [time_words(time_shares(r.goodput), "") for run in runs.runs for r in run.ranks]
    found |= {n for text in shares for n in NUMBER.findall(text)}  # where the time went
    headers = [c.header for c in (*terminal.LIVE_RANK_COLUMNS, *terminal.LIVE_GPU_COLUMNS)]
    found |= {n for h in [*headers, "http://127.0.0.1:9478"] for n in NUMBER.findall(h)}
    return found


@pytest.mark.parametrize("width", [80, 100, 120, 200])
def test_every_number_on_screen_is_whole(width: int) -> None:
    screen = render(width)
    assert max(len(line) for line in screen.splitlines()) <= width
    cut = [n for n in NUMBER.findall(screen) if n not in source_numbers()]
    assert not cut, f"numbers cut at {width} columns: {cut}\n{screen}"
    # The columns that identify a rank and its progress survive even at 80 columns.
    for value in ("1/8", "1499", "2499", "3499", "crashed", "NaN/Inf", "gpt2-medium-finetune"):
        assert re.search(rf"(?<![\w./]){re.escape(value)}(?![\w./])", screen), (value, screen)
    assert "79" in NUMBER.findall(screen)  # the GPU with XIDs keeps its count


@pytest.mark.parametrize("width", [80, 100])
def test_narrow_terminal_names_hidden_columns(width: int) -> None:
    screen = " ".join(render(width).split())
    assert "hidden for width:" in screen
    # A hidden column's header is gone along with its values, never shown half.
    shown, dropped = terminal.fit_columns(
        terminal.LIVE_RANK_COLUMNS, terminal.rank_rows(*api_bodies()), width
    )
    assert dropped and all(h in screen for h in dropped)
    assert {k for k, _, _, _ in shown} >= {"run", "rank", "status", "step", "loss"}


def test_wide_terminal_shows_every_column() -> None:
    screen = render(200)
    assert "hidden for width" not in screen
    for c in terminal.LIVE_RANK_COLUMNS:
        assert c.header in screen, c.header
    assert "gpu-node-7.cluster.example.org" in screen and "123456" in screen


def test_every_width_from_40_to_200_keeps_numbers_whole() -> None:
    known = source_numbers()
    for width in range(40, 201, 7):
        screen = render(width)
        cut = [n for n in NUMBER.findall(screen) if n not in known]
        assert not cut, (width, cut)


def test_a_column_is_never_hidden_while_a_less_urgent_one_shows() -> None:
    """docs/status.md's order at every width: goodput used to be hidden from 100 to 110
    columns while gpu and gpu mem, less urgent, were shown (a narrow column taken after a
    wide one was skipped)."""
    rows = terminal.rank_rows(*api_bodies())
    priority = {c.key: c.priority for c in terminal.LIVE_RANK_COLUMNS}
    for width in range(40, 201):
        shown, _ = terminal.fit_columns(terminal.LIVE_RANK_COLUMNS, rows, width)
        keys = {k for k, _, _, _ in shown}
        optional = [c for c in terminal.LIVE_RANK_COLUMNS if not c.kept]
        least_urgent_shown = max((c.priority for c in optional if c.key in keys), default=0)
        hidden = [c.key for c in optional if c.key not in keys]
        assert all(priority[k] > least_urgent_shown for k in hidden), (width, hidden, keys)
    order = sorted(optional, key=lambda c: -c.priority)
    assert [c.header for c in order] == [
        *["gpu mem", "loss ema", "gpu util", "gpu", "host", "mfu", "tokens/s", "loss", "step"],
    ]  # the order docs/status.md gives; goodput has its own table, never hidden


def test_where_the_time_went_is_shown_at_every_width() -> None:
    """Every rank's goodput, its time as a bar and in words, at every width: the ranks table
    used to hide goodput below 120 columns, and showed only its largest badput."""
    for width in range(40, 201, 7):
        screen = render(width)
        flat = " ".join(re.sub("[│┃]", " ", screen).split())  # a wrapped cell read on
        assert "where the time went, since each rank's init()" in flat, (width, screen)
        for words in ("productive 83.3%", "uncheckpointed 7.9%", "data loading 4.6%"):
            assert flat.count(words) == 3, (width, words, screen)
        assert "█ productive · ▓ uncheckpointed · s start-up · d data loading" in flat, width
        bars = re.findall(r"│ \d/8 +│ 91\.2% +│ (█+▓+[dsc]*) +│", screen)
        assert len(bars) == 3, (width, screen)  # each rank's goodput, then its bar


def test_once_writes_every_cell_of_the_view_model() -> None:
    crashed = v.rank(
        1,
        status="crashed",
        hostname="",
        step=None,
        values={"loss": None},
        loss_ema=None,
        tokens_per_second=None,
        mfu_ratio=None,
        mfu_unavailable_reason="unknown_gpu_model",  # a crashed rank needs no MFU reason
        gpu=None,
        health=["crashed"],
        events=[v.event("crash", 12)],
    )
    gpus = v.gpus(
        v.gpu(1, slowdown_reasons=["hw_slowdown", "sw_thermal_slowdown"], xid_errors=2),
        v.gpu(0, tensor_active_ratio=None, memory_used_bytes=None),
        lost_total=1,
    )
    got = terminal.plain(v.runs(v.rank(0), crashed), gpus).splitlines()
    # Split the way a script does: on runs of two spaces or more.
    rows = [re.split(r"\s{2,}", line) for line in got]
    assert rows[0] == ["# ranks"]
    assert rows[1] == list(terminal.RANK_COLUMNS)
    assert rows[2] == [
        *["gpt2-medium-finetune", "0/8", "gpu-node-7.cluster.example.org", "running", "1499"],
        *["2.346", "2.568", "123456", "41.7%", "91.2% (data_loading)", "0", "93.0%", "-", "ok"],
    ]
    assert rows[3] == [
        *["gpt2-medium-finetune", "1/8", "-", "crashed", "-", "NaN/Inf", "-", "-"],
        *["-", "91.2% (data_loading)", "-", "-", "-", "crashed; last event crash at step 12"],
    ]
    assert rows[4] == [""]
    assert rows[5] == ["# gpus (driver 550.54.15, 1 lost)"]
    assert rows[6] == list(terminal.GPU_COLUMNS)
    assert rows[7] == [
        *["0", "NVIDIA H100 80GB HBM3", "93.0%", "-", "-", "80.0", "612", "67", "none", "0"]
    ]
    assert rows[8] == [
        *["1", "NVIDIA H100 80GB HBM3", "93.0%", "61.0%", "71.0", "80.0", "612", "67"],
        *["hw_slowdown,sw_thermal_slowdown", "2"],
    ]
    assert len(rows) == 9


def test_once_without_gpus_says_why() -> None:
    out = terminal.plain(v.runs(), v.no_gpus("NVML Shared Library Not Found"))
    assert out.endswith("\n# gpus: none (NVML Shared Library Not Found)\n")


def test_live_view_colours_problems() -> None:
    runs, gpus = api_bodies()
    console = Console(record=True, width=200, color_system="standard", force_terminal=True)
    console.print(terminal.rich_view(runs, gpus, "http://127.0.0.1:9478"))
    screen = console.export_text(styles=True)
    bold_red = re.escape("\x1b[1;31m")
    assert re.search(rf"{bold_red}\s*crashed", screen)  # the crashed rank's row
    assert re.search(r"\x1b\[[0-9;]*33mnonfinite_loss", screen)  # its anomalies, in yellow
    assert re.search(rf"{bold_red}\s*79", screen)  # the GPU with XIDs
    assert not re.search(rf"{bold_red}\s*running", screen)


def hostile_bodies() -> tuple[RunsResponse, GpusResponse, GpusResponse]:
    """Every string the terminal shows set to terminal controls: a rank and a GPU, and an
    NVML failure."""
    h = v.HOSTILE
    rank = v.rank(
        0,
        hostname=h,
        status=h,
        health=[h],
        events=[v.event(h, 12)],
        custom={h: 1.0},
        mfu_ratio=None,
        mfu_unavailable_reason=h,
    )
    gpu = v.gpu(0, name=h, slowdown_reasons=[h])
    return v.runs(rank, run=h), v.gpus(gpu, driver_version=h), v.no_gpus(h, h)


def test_no_control_character_from_the_api_reaches_the_terminal() -> None:
    runs, gpus, failed = hostile_bodies()
    for g in (gpus, failed):
        out = terminal.plain(runs, g)
        assert not v.controls(out), out
        assert "a\\x1b[31mred" in out  # shown, inert
        for width in (80, 120, 200):
            console = Console(record=True, width=width, color_system=None)
            console.print(terminal.rich_view(runs, g, "http://127.0.0.1:9478"))
            screen = console.export_text()
            assert not v.controls(screen), (width, screen)


GENERATED_RUN = "pretrain_gpt2_124m_v12-20261126-001523-ab12"  # as detect_run_id makes one


def cpu_host_screen(width: int) -> str:
    """A run with a generated id whose second rank logged a NaN, on a node without a GPU."""
    nan = v.rank(
        1,
        values={"loss": None},
        health=["non-finite values: loss x1, grad_norm x0"],
        events=[v.event("nonfinite_loss", 40)],
        gpu=None,
    )
    runs = v.runs(v.rank(0, gpu=None), nan, run=GENERATED_RUN)
    gpus = v.no_gpus("NVML Shared Library Not Found", "install the NVIDIA driver, then restart")
    console = Console(record=True, width=width, color_system=None)
    console.print(terminal.rich_view(runs, gpus, "http://127.0.0.1:9478"))
    return console.export_text()


@pytest.mark.parametrize("width", [60, 80, 100, 120])
def test_a_generated_run_id_is_shortened_and_health_never_hidden(width: int) -> None:
    assert len(GENERATED_RUN) == 43
    screen = cpu_host_screen(width)
    assert max(len(line) for line in screen.splitlines()) <= width
    flat = " ".join(screen.split())
    assert "anomalies" in flat and ("NaN/Inf" in flat or width < 80)
    last_column = " ".join(
        line.split("│")[-2].strip() for line in screen.splitlines() if line.startswith("│")
    )
    assert "ok non-finite values: loss x1, grad_norm x0; last event nonfinite_loss" in last_column
    assert "hidden for width" in flat and "anomalies" not in flat.split("hidden for width")[1]
    shortened = re.search(r"(pretrain\S*)…(\S*ab12)", screen)
    assert shortened, screen
    assert GENERATED_RUN.startswith(shortened[1]) and GENERATED_RUN.endswith(shortened[2])


@pytest.mark.parametrize("width", [80, 120])
def test_a_node_without_gpus_gets_one_line_not_an_empty_table(width: int) -> None:
    lines = cpu_host_screen(width).rstrip("\n").splitlines()
    assert lines[-1].startswith("GPUs: no GPU metrics (NVML Shared Library Not Found).")
    assert "xids" not in "\n".join(lines) and "Hint" not in lines[-2]
    assert [line for line in lines if "NVML" in line] == [lines[-1]]


def test_a_run_id_keeps_both_ends_when_shortened() -> None:
    assert shorten_middle(GENERATED_RUN, 20) == "pretrain_g…1523-ab12"
    assert shorten_middle("short", 20) == "short"
    assert shorten_middle("日本語のランID-0001", 10) == "日本語…001"  # 10 cells: CJK are two wide
    for width in range(1, 44):
        assert len(shorten_middle(GENERATED_RUN, width)) <= width


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["stauts"], "trainmon: error: no command 'stauts' (did you mean status?)"),
        (
            ["status", "--onec"],
            "trainmon status: error: unrecognized arguments: --onec (did you mean --once?)",
        ),
        (
            ["status", "--url=x", "--intervall", "2"],
            "trainmon status: error: unrecognized arguments: --intervall 2 (did you mean "
            "--interval?)",
        ),
        (["status", "--nothing-alike"], "unrecognized arguments: --nothing-alike\n"),
    ],
)
def test_a_typo_gets_the_closest_command_or_flag(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert terminal.cli(argv) == 2
    err = capsys.readouterr().err
    assert said in err, err
