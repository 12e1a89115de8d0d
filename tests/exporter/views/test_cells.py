"""The cells both views write: one rule each, two sets of marks."""

from __future__ import annotations

import pytest

from trainmon_exporter.views.cells import GIB, NONFINITE, PAGE, TERMINAL, Cells, printable

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


def test_mfu_is_a_percentage_or_why_there_is_none() -> None:
    assert PAGE.mfu(v.rank(mfu_ratio=0.417)) == "41.7 %"
    assert TERMINAL.mfu(v.rank(mfu_ratio=0.417)) == "41.7%"
    why = v.rank(mfu_ratio=None, mfu_unavailable_reason="no_peak_flops")
    assert PAGE.mfu(why) == "– (no_peak_flops)"
    assert TERMINAL.mfu(why) == "-(no_peak_flops)"
    unknown = v.rank(mfu_ratio=None, mfu_unavailable_reason=None)
    assert PAGE.mfu(unknown) == "–" and TERMINAL.mfu(unknown) == "-"


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
