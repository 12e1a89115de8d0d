"""The cells both views write: one rule each, two sets of marks."""

from __future__ import annotations

import time

import pytest

from trainmon_exporter.views.api import RunsResponse
from trainmon_exporter.views.cells import (
    GIB,
    MFU_WORDS,
    NONFINITE,
    PAGE,
    TERMINAL,
    Cells,
    printable,
    rank_status,
    stopped,
)

from ...conftest import InProcessExporter, connect, wait_for
from ...helpers import views as v


@pytest.mark.parametrize("cells", [PAGE, TERMINAL])
def test_a_missing_value_is_the_views_mark(cells: Cells) -> None:
    assert cells.number(None, ".1f") == cells.missing
    assert cells.percent(None) == cells.missing
    assert cells.gib(None) == cells.missing
    assert cells.logged({}, "loss", ".4g") == cells.missing  # never reported
    assert cells.number(1234.5678, ",.0f") == "1,235"


@pytest.mark.parametrize("cells", [PAGE, TERMINAL])
def test_a_reported_null_is_nonfinite(cells: Cells) -> None:
    # JSON has no NaN or Inf: the API reports such a value as null, under its key.
    assert cells.logged({"loss": None}, "loss", ".4g") == NONFINITE == "NaN/Inf"
    assert cells.logged({"loss": 2.34567}, "loss", ".4g") == "2.346"


def test_mfu_is_a_percentage_or_why_there_is_none_in_words() -> None:
    assert PAGE.mfu(v.rank(mfu_ratio=0.417)) == "41.7 %"
    assert TERMINAL.mfu(v.rank(mfu_ratio=0.417)) == "41.7%"
    why = v.rank(mfu_ratio=None, mfu_unavailable_reason="no_gpu_uuid")
    assert PAGE.mfu(why) == "– (no GPU)"
    assert TERMINAL.mfu(why) == "-(no GPU)"
    unknown = v.rank(mfu_ratio=None, mfu_unavailable_reason=None)
    assert PAGE.mfu(unknown) == "–" and TERMINAL.mfu(unknown) == "-"
    # A reason a newer exporter sends is still words, not code.
    assert TERMINAL.mfu(v.rank(mfu_ratio=None, mfu_unavailable_reason="new_reason")) == (
        "-(new reason)"
    )


def test_every_mfu_reason_the_exporter_gives_has_words() -> None:
    from trainmon_exporter.collectors.rank_gpu import MFU_REASONS

    assert set(MFU_WORDS) == set(MFU_REASONS)
    for words, why in MFU_WORDS.values():
        assert "_" not in words and "  " not in words and len(words) <= 18 and why


@pytest.mark.parametrize("status", ["crashed", "failed", "finished"])
def test_a_rank_that_no_longer_runs_has_no_current_throughput(status: str) -> None:
    rank = v.rank(status=status, up=False)
    assert rank_status(rank) == status and stopped(rank)
    for cells in (PAGE, TERMINAL):
        assert cells.throughput(rank, ".0f") == cells.missing
        assert cells.mfu(rank) == cells.missing


def test_a_running_rank_whose_connection_closed_is_disconnected() -> None:
    rank = v.rank(status="running", up=False)
    assert rank_status(rank) == "disconnected" and stopped(rank)
    assert TERMINAL.throughput(rank, ".0f") == "-"
    assert TERMINAL.throughput(v.rank(), ".0f") == "123456"
    assert not stopped(v.rank())


def test_memory_is_gib_with_one_decimal() -> None:
    assert GIB == 2**30
    assert PAGE.gib(71 * 2**30) == TERMINAL.gib(71 * 2**30) == "71.0"
    assert PAGE.gib(80e9) == "74.5"


def test_printable_escapes_every_control_character() -> None:
    out = printable(v.HOSTILE)
    assert all(c.isprintable() for c in out), repr(out)
    assert out == (
        "a\\x1b[31mred\\x1b]0;owned\\x07b\\x1b]8;;http://x\\x1b\\c\\x9b2Jd\\x9d0;t\\x9ce\\x7ff"
        "\\x0ag\\u202eh"
    )
    assert printable("gpt2-124m node7 · 41.7 % é 日本") == "gpt2-124m node7 · 41.7 % é 日本"


def test_a_rank_that_never_logged_tokens_has_no_throughput_to_show(
    exporter: InProcessExporter,
) -> None:
    """A real exporter's answer for a trainer that logs no tokens says 0 tokens/s; both views
    show the missing mark, not a speed of 0 (it used to read as a stalled run)."""
    run = connect(exporter, "no-tokens")
    for step in range(30):  # over 0.5 s: a rate the exporter reports
        run.log(step, loss=2.0)
        time.sleep(0.03)
    wait_for(lambda: (k := exporter.rank("no-tokens", 0)) and k["step"] == 29)
    runs = RunsResponse.model_validate(exporter.runs())
    (rank,) = runs.runs[0].ranks
    assert rank.tokens_total == 0 and rank.tokens_per_second == 0.0
    assert TERMINAL.throughput(rank, ".0f") == "-" and PAGE.throughput(rank, ",.0f") == "–"
    assert TERMINAL.throughput(v.rank(tokens_total=0.0), ".0f") == "-"
    assert TERMINAL.throughput(v.rank(), ".0f") == "123456"  # one that logged tokens
    run.finish()
