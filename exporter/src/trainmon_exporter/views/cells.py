"""How a value of the view model is written in a table cell: the status page and the terminal.

Both views apply the same rules; only their marks differ (:data:`PAGE`, :data:`TERMINAL`):
a missing value is a dash, a value that was reported but is NaN or infinite is ``NaN/Inf``
(JSON has neither, so the API sends null for it), MFU is a percentage or the reason it has
none, and memory is shown in GiB.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainmon_exporter.views.api import RankView

NONFINITE = "NaN/Inf"
"""A logged value that was reported but is NaN or infinite."""

GIB = 2.0**30
"""Bytes in a GiB."""


def scale(v: float | None, k: float) -> float | None:
    """``v * k``, or ``None`` for a missing value."""
    return None if v is None else v * k


@dataclass(frozen=True)
class Cells:
    """One view's marks for the cells of the view model."""

    missing: str
    """Stands for a value that is not there."""
    gap: str
    """Goes before ``%`` and before the reason in parentheses after a missing MFU."""

    def number(self, v: float | None, fmt: str) -> str:
        """``v`` formatted with ``fmt``, or the missing mark."""
        return self.missing if v is None else format(v, fmt)

    def logged(self, values: Mapping[str, float | None], key: str, fmt: str) -> str:
        """A logged value (``RankView.values``): null when reported means NaN or infinite."""
        if key in values and values[key] is None:
            return NONFINITE
        return self.number(values.get(key), fmt)

    def percent(self, ratio: float | None) -> str:
        """A ratio as a percentage with one decimal (``41.7%``)."""
        return self.missing if ratio is None else f"{ratio * 100:.1f}{self.gap}%"

    def mfu(self, rank: RankView) -> str:
        """The rank's MFU as a percentage, else the missing mark and why (``- (no_peak)``)."""
        if rank.mfu_ratio is not None:
            return self.percent(rank.mfu_ratio)
        reason = rank.mfu_unavailable_reason
        return f"{self.missing}{self.gap}({reason})" if reason else self.missing

    def gib(self, nbytes: float | None) -> str:
        """Bytes as GiB with one decimal."""
        return self.number(None if nbytes is None else nbytes / GIB, ".1f")


PAGE = Cells(missing="–", gap=" ")
"""The status page: an en dash, and ``41.7 %``."""

TERMINAL = Cells(missing="-", gap="")
"""``trainmon status``: an ASCII dash, and ``41.7%`` (a number's cell holds no space)."""
