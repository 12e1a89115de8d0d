"""How a value of the view model is written in a table cell: the status page and the terminal.

Both views apply the same rules; only their marks differ (:data:`PAGE`, :data:`TERMINAL`):
a missing value is a dash, a value that was reported but is NaN or infinite is ``NaN/Inf``
(JSON has neither, so the API sends null for it), MFU is a percentage or, in words, the
reason it has none, a rank that no longer runs has no current throughput, and memory is
shown in GiB. Every string that came from the API goes through
:func:`printable` before either view shows it.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from unicodedata import east_asian_width

from trainmon_exporter.views.api import GoodputView, RankView, RunView

NONFINITE = "NaN/Inf"
"""A logged value that was reported but is NaN or infinite."""


def cell_len(text: str) -> int:
    """Terminal cells ``text`` takes: two for a wide (East Asian) character, else one."""
    return sum(2 if east_asian_width(ch) in "WF" else 1 for ch in text)


GIB = 2.0**30
"""Bytes in a GiB."""


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""C0 and C1 control characters, DEL, and the Unicode bidirectional controls."""


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str) -> str:
    r"""``text`` with every control character written as its escape (``\x1b``, ``\u202e``).

    Run ids, hostnames, metric and GPU names and error texts come from clients and from the
    network: an ESC, CSI (``\x9b``) or OSC sequence in one would move the cursor, recolour
    or retitle the terminal that prints it, and a newline or bidirectional override would
    forge rows. Escaped, what is left is inert text that still shows what was sent (two ids
    that differ only by a control character stay different).
    """
    return _CONTROL.sub(_escape, text)


MFU_WORDS: Mapping[str, tuple[str, str]] = {
    "no_flops_per_token": ("model size unknown", "the trainer did not pass num_params to init"),
    "no_gpu_uuid": ("no GPU", "the trainer reported no CUDA device (a CPU run)"),
    "gpu_not_sampled": (
        "GPU not seen",
        "NVML on this node does not show the trainer's GPU (no NVML, or another node's GPU)",
    ),
    "unknown_gpu_model": ("GPU peak unknown", "the GPU model is not in the peak table"),
    "unknown_dtype": ("dtype peak unknown", "the GPU has no tensor-core peak for the dtype"),
}
"""Why a rank has no MFU (``RankView.mfu_unavailable_reason``): a few words for the cell and a
sentence for the status page's tooltip (docs/metrics.md lists the reasons)."""


def mfu_reason(reason: str) -> tuple[str, str]:
    """``(words, explanation)`` for an MFU reason code; an unknown code is shown as words."""
    known = MFU_WORDS.get(reason)
    return known if known is not None else (reason.replace("_", " "), "")


def rank_status(rank: RankView) -> str:
    """The rank's status in a word.

    ``running``, ``finished``, ``failed``, ``crashed``, or ``disconnected`` (its connection
    closed without a verdict, e.g. idle or an exporter restart).
    """
    return "disconnected" if rank.status == "running" and not rank.up else rank.status


def stopped(rank: RankView) -> bool:
    """Whether the rank no longer runs.

    Such a rank has no current throughput: a dash, not its last speed (:func:`rank_status`
    says why).
    """
    return rank_status(rank) != "running"


def shorten_middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` terminal cells, its middle replaced by ``…`` when longer.

    Both ends stay: a generated run id (``<script>-<date>-<time>-<hex>``) keeps its script and
    the time and digest that tell two launches apart.
    """
    if cell_len(text) <= width:
        return text
    if width <= 1:
        return "…"[:width]
    head = tail = ""
    left, right = 0, len(text)
    room = width - 1
    while room > 0 and left < right:  # take characters from both ends in turn
        c = text[left] if len(head) <= len(tail) else text[right - 1]
        if cell_len(c) > room:
            break
        if len(head) <= len(tail):
            head, left = head + c, left + 1
        else:
            tail, right = c + tail, right - 1
        room -= cell_len(c)
    return f"{head}…{tail}"


TIME_PARTS: Mapping[str, tuple[str, str, str]] = {
    "productive": ("█", "productive", "#2e7d32"),
    "uncheckpointed": ("▓", "uncheckpointed", "#8bc34a"),
    "startup": ("s", "start-up", "#78909c"),
    "data_loading": ("d", "data loading", "#f9a825"),
    "checkpoint_save": ("c", "checkpoint save", "#1565c0"),
    "checkpoint_restore": ("r", "checkpoint restore", "#42a5f5"),
    "evaluation": ("e", "evaluation", "#00897b"),
    "hang": ("h", "hang", "#7a3fbf"),
    "wasted_progress": ("w", "wasted progress", "#c62828"),
    "recovery": ("v", "recovery", "#ef6c00"),
    "other": ("o", "other", "#bdbdbd"),
}
"""The parts a rank's wall-clock splits into (docs/goodput.md): productive and uncheckpointed
step time, then the badput kinds. Each with its character in the terminal's bar (a block for
the time that trained, a letter for each kind of badput, so the bar reads without colour), its
words, and its colour on the page."""


def time_part(part: str) -> tuple[str, str, str]:
    """``(character, words, colour)`` of ``part``; a kind from a newer exporter gets ``?``."""
    return TIME_PARTS.get(part) or ("?", part.replace("_", " "), "#000000")


def time_shares(g: GoodputView | None) -> list[tuple[str, float]]:
    """Where a rank's time went: ``(part, share of its accounted seconds)`` above 0.

    Productive first, then uncheckpointed, then the badput kinds from the largest. Empty when
    nothing is accounted yet (or an older exporter sends no goodput). The shares sum to 1;
    each figure is scaled by the largest before summing, so none overflows.
    """
    if g is None:
        return []
    seconds = {"productive": g.productive_seconds, "uncheckpointed": g.uncheckpointed_seconds}
    badput = sorted(g.badput_seconds.items(), key=lambda kv: -kv[1])
    seconds.update(badput)
    present = {k: v for k, v in seconds.items() if math.isfinite(v) and v > 0}
    if not present:
        return []
    top = max(present.values())
    total = sum(v / top for v in present.values())
    return [(k, v / top / total) for k, v in present.items()]


def time_words(shares: list[tuple[str, float]], gap: str) -> str:
    """``productive 91.2% · data loading 4.1% · …``: each part and its share, in order.

    A part under 0.05 % is ``<0.1%``: there, not nothing.
    """
    return " · ".join(
        f"{time_part(k)[1]} {'<0.1' if v < 0.0005 else f'{v * 100:.1f}'}{gap}%" for k, v in shares
    )


def time_bar(shares: list[tuple[str, float]], width: int) -> list[str]:
    """The parts of a ``width``-cell bar, one part name per cell, in the order of ``shares``.

    Cells are shared out by the largest remainder, so the bar always fills ``width`` and a
    part's cells differ from its exact share by less than one.
    """
    if not shares or width <= 0:
        return []
    exact = [v * width for _, v in shares]
    cells = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: cells[i] - exact[i])
    for i in by_remainder[: width - sum(cells)]:
        cells[i] += 1
    return [k for (k, _), n in zip(shares, cells, strict=True) for _ in range(n)]


def overflow(v: float) -> str:
    """An infinite product of finite values, as the bound it passed: ``>1.798e+308``."""
    return f"{'<-' if v < 0 else '>'}{sys.float_info.max:.4g}"


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
        """``v`` formatted with ``fmt``, or the missing mark.

        A value a view scaled past the float range (``1e308`` seconds in milliseconds) is
        written as the bound it passed, ``>1.798e+308``: never ``inf``, never 309 digits.
        """
        if v is None:
            return self.missing
        if not math.isfinite(v):
            return overflow(v)
        return format(v, fmt)

    def logged(self, values: Mapping[str, float | None], key: str, fmt: str) -> str:
        """A logged value (``RankView.values``): null when reported means NaN or infinite."""
        if key in values and values[key] is None:
            return NONFINITE
        return self.number(values.get(key), fmt)

    def percent(self, ratio: float | None) -> str:
        """A ratio as a percentage with one decimal (``41.7%``)."""
        if ratio is None:
            return self.missing
        p = ratio * 100
        return f"{p:.1f}{self.gap}%" if math.isfinite(p) else f"{overflow(p)}{self.gap}%"

    def mfu(self, rank: RankView) -> str:
        """The rank's MFU as a percentage, else the missing mark and why (``- (no GPU)``).

        A rank that no longer runs has none, and needs no reason: its status says why.
        """
        if stopped(rank):
            return self.missing
        if rank.mfu_ratio is not None:
            return self.percent(rank.mfu_ratio)
        reason = rank.mfu_unavailable_reason
        if not reason:
            return self.missing
        return f"{self.missing}{self.gap}({mfu_reason(reason)[0]})"

    def goodput(self, rank: RankView) -> str:
        """The rank's goodput as a percentage and its largest badput (``91.2% (data_loading)``).

        A rank that never reported its data waits says so: ``97.0% (data unmeasured)``.
        """
        g = rank.goodput
        if g is None or g.ratio is None:
            return self.missing
        text = self.percent(g.ratio)
        notes = [g.largest_badput] if g.largest_badput else []
        if not g.data_loading_measured:
            notes.append("data unmeasured")
        return f"{text} ({', '.join(notes)})" if notes else text

    def job(self, run: RunView) -> str | None:
        """A run's job-wide goodput in one line: over the ranks here, then across nodes.

        ``llama: goodput here 41.2% (data_loading) · waits on rank 3 for its input · data
        loading unmeasured on ranks 0, 1 · whole job 38.0%, last hour 35.0%``. None before
        anything is accounted.
        """
        if run.goodput_ratio is None and run.job is None:
            return None
        parts = [f"{run.label}: goodput here {self.percent(run.goodput_ratio)}"]
        if run.largest_badput:
            parts[0] += f" ({run.largest_badput})"
        if run.departed_ranks:
            left = ", ".join(map(str, run.departed_ranks))
            parts.append(f"with the accounting of ranks {left}, which left")
        if run.waits_on_rank is not None:
            parts.append(f"waits on rank {run.waits_on_rank} for its input")
        if run.data_loading_unmeasured:
            ranks = ", ".join(map(str, run.data_loading_unmeasured))
            parts.append(f"data loading unmeasured on ranks {ranks}")
        j = run.job
        if j is not None:
            whole = f"whole job {self.percent(j.goodput_ratio)}"
            if j.goodput_ratio_1h is not None:
                whole += f", last hour {self.percent(j.goodput_ratio_1h)}"
            if j.waits_on_rank is not None:
                where = f" on {j.waits_on_hostname}" if j.waits_on_hostname else ""
                whole += f", waits on rank {j.waits_on_rank}{where}"
            parts.append(whole)
        return " · ".join(parts)

    def throughput(self, rank: RankView, fmt: str) -> str:
        """The rank's tokens/s, or the missing mark.

        Missing once the rank no longer runs, and for a rank that never logged tokens: its
        rate of 0 says nothing about its speed.
        """
        if stopped(rank) or rank.tokens_total == 0:
            return self.missing
        return self.number(rank.tokens_per_second, fmt)

    def gib(self, nbytes: float | None) -> str:
        """Bytes as GiB with one decimal."""
        return self.number(None if nbytes is None else nbytes / GIB, ".1f")


PAGE = Cells(missing="–", gap=" ")
"""The status page: an en dash, and ``41.7 %``."""

TERMINAL = Cells(missing="-", gap="")
"""``trainmon status``: an ASCII dash, and ``41.7%`` (a number's cell holds no space)."""
