"""Ranks with a history, for the sparklines: real rank states fed synthetic steps at fixed
client times, so their trends (:func:`trainmon_exporter.derive.trend`) are the same on every
machine (the views' golden captures)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

from trainmon_client import _protocol as P
from trainmon_exporter import derive
from trainmon_exporter.state import rank
from trainmon_exporter.state.rank import RankState
from trainmon_exporter.views import api
from trainmon_exporter.views.api import GoodputView, RankView, RunsResponse, trend_view

from . import views as v
from .exporter import make_state

T0 = v.T - 240 * 0.25
"""Client time of the first step: 240 steps of 0.25 s end at the views' "now"."""
RUN = "pretrain_gpt2_124m_v12-20261126-001523-ab12"
"""A run id as ``detect_run_id`` generates one (43 characters)."""


class _Clock:
    """The exporter's clocks during :func:`states`: each step arrives 1 ms after its client
    time, and monotonic time equals wall time, so the goodput accounting is reproducible."""

    def __init__(self) -> None:
        self.now = T0 - 2.0  # the ranks' init(): 2 s of start-up before the first step

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


@contextmanager
def _clock() -> Iterator[_Clock]:
    c = _Clock()
    saved = list(rank._offset)
    try:
        with mock.patch.object(rank, "time", c):
            yield c
    finally:
        rank._offset[:] = saved


CHECKPOINT_EVERY = 100
"""Steps between two checkpoint saves in :func:`feed`."""


def healthy_loss(step: int) -> float:
    """A loss that falls from about 6 towards 2, with a little deterministic noise."""
    return 2.0 + 4.0 * math.exp(-step / 60) + 0.04 * math.sin(step * 1.7)


def feed(
    s: RankState,
    count: int = 240,
    step_of: Callable[[int], int] = lambda i: i,
    loss_of: Callable[[int], float | None] = healthy_loss,
    tokens_of: Callable[[int], float] = lambda i: 16384.0,
    gap_after: dict[int, float] | None = None,
    clock: _Clock | None = None,
) -> None:
    """``count`` logged steps, 0.25 s apart from :data:`T0` (plus ``gap_after[i]`` seconds
    after the ``i``-th), ``tokens_of(i)`` tokens each, 0.02 s of each waiting for data, and a
    checkpoint of 1 s saved after every :data:`CHECKPOINT_EVERY` steps. A gap judged a hang
    is accounted as the exporter's detector clock does (``Goodput.hung``)."""
    when, tokens = T0, 0.0
    for i in range(count):
        tokens += tokens_of(i)
        loss = loss_of(i)
        head = P.StepHeader(step_of(i), i + 1, when, 0.25, tokens, 32.0 * (i + 1), 0.0, 0, 0, 0)
        ids: tuple[int, ...] = (P.FIELD_DATA_TIME,)
        values: tuple[float, ...] = (0.02,)
        if loss is not None:
            ids, values = (P.FIELD_LOSS, *ids), (loss, *values)
        if clock is not None:
            clock.now = when + 0.001
        s.observe_step(P.Step(head, ids, values), {}, 30.0)
        gap = (gap_after or {}).get(i, 0.0)
        if gap_after and i in gap_after:
            s.analytics.check_hang(gap, busy=False)
            if clock is not None:
                clock.now = when + gap
            s.goodput.hung(when + gap, s.analytics.median_interval())
        if (i + 1) % CHECKPOINT_EVERY == 0:
            gap += 1.0
            if clock is not None:
                clock.now = when + gap
            s.observe_checkpoint(P.Checkpoint(step_of(i), when + gap, 1.0))
        when += 0.25 + gap


def states() -> list[RankState]:
    """Four ranks of :data:`RUN`: healthy with one loss spike; a NaN and a throughput that
    halves; a checkpoint rollback; a hang."""
    ranks = []
    for r in range(4):
        with _clock() as c:
            ranks.append(make_state())
            if r == 0:
                feed(ranks[0], loss_of=lambda i: 40.0 if i == 150 else healthy_loss(i), clock=c)
            elif r == 1:
                feed(
                    ranks[1],
                    loss_of=lambda i: math.nan if i == 200 else healthy_loss(i) + 0.05,
                    tokens_of=lambda i: 16384.0 if i < 120 else 8192.0,
                    clock=c,
                )
            elif r == 2:
                feed(ranks[2], step_of=lambda i: i if i < 180 else i - 40, clock=c)  # to 140
            else:
                feed(ranks[3], gap_after={100: 90.0}, clock=c)  # 90 s without a step
    return ranks


def goodput_view(s: RankState) -> GoodputView:
    """Where the rank's time went, as the API shows it; its data share and input-bound
    verdict, which read the machine's clock, left out."""
    view = api._goodput_view(s, 30.0, s.analytics.cfg)
    return view.model_copy(update={"data_loading_share": None, "input_bound": None})


def rank_views() -> list[RankView]:
    """The four :func:`states` as the API shows them (other fields from ``views.rank``)."""
    out = []
    for r, s in enumerate(states()):
        last = s.values.get("loss")
        values = {"loss": None if last is None or not math.isfinite(last) else last}
        health = ["non-finite values: loss x1, grad_norm x0"] if s.nonfinite["loss"] else []
        kinds = [e.kind for e in s.analytics.events]
        events = [v.event(k, e.step) for k, e in zip(kinds, s.analytics.events, strict=True)]
        out.append(
            v.rank(
                r,
                world_size=4,
                step=s.step,
                values=values,
                health=health,
                events=events,
                tokens_per_second=[65536.0, 32768.0, 65536.0, 65536.0][r],
                trend=trend_view(derive.trend(s)),
                goodput=goodput_view(s),
            )
        )
    return out


def runs() -> RunsResponse:
    """:func:`rank_views` in one run named :data:`RUN`."""
    return v.runs(*rank_views(), run=RUN)
