"""A job's goodput from its ranks' accounting: the definitions of the recording rules.

The recording rules (``deploy/prometheus/trainmon.rules.yml``) compute a job's figures where
every node is visible; this module computes the same over the ranks one exporter holds (its
connected ranks and the departed ones it keeps), for the JSON API, the status page and
``trainmon status``. The definitions, side by side with the rules' (docs/goodput.md):

- a rank's time at risk (held step time of a process that ended without a clean finish) is
  ``wasted_progress``, never good;
- **the critical path**: a synchronous job goes at its slowest rank's pace, so while one rank
  waits for its input the others wait for it in a collective. The job's data loading is the
  largest share of its time any rank waited for data, over every rank's time; the difference
  to the ranks' own waits (the time fast ranks sat in a collective for the slow loader,
  :attr:`JobGoodput.collective_wait`) comes out of their step time. Where a rank is
  straggling (ranks that do not wait for each other), each rank keeps its own figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from trainmon_exporter.analytics.goodput import KINDS, Goodput

__all__ = ["JobGoodput", "RankTime", "job_goodput"]


@dataclass(slots=True)
class RankTime:
    """One rank's accounting as the job's figures read it (seconds)."""

    rank: int
    good: float
    """Productive plus uncheckpointed step time."""
    badput: dict[str, float]
    """By kind, time at risk in ``wasted_progress``."""
    straggling: bool = False
    """The straggler verdict: this rank does not keep pace with the others."""
    data_share: float | None = None
    """Its data waits over its step time in the rate window (for :attr:`JobGoodput.waits_on`)."""
    data_measured: bool = True
    """It reported its data waits at least once."""

    @classmethod
    def of(
        cls,
        rank: int,
        g: Goodput,
        straggling: bool = False,
        data_share: float | None = None,
    ) -> RankTime:
        """The figures of ``g``, the accounting of ``rank``."""
        return cls(
            rank,
            g.productive + g.uncheckpointed,
            g.lost(),
            straggling,
            data_share,
            g.data_seen,
        )

    @property
    def accounted(self) -> float:
        """Everything accounted (s)."""
        return self.good + sum(self.badput.values())


@dataclass(slots=True)
class JobGoodput:
    """A job's goodput over some of its ranks (seconds are rank-seconds)."""

    good: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    collective_wait: float = 0.0
    """Step time of fast ranks spent waiting in a collective for the slowest loader: counted
    as the job's ``data_loading`` (included in :attr:`badput`), not as good."""
    waits_on: int | None = None
    """The rank with the largest data-wait share in the rate window (None: no wait seen)."""
    unmeasured: list[int] = field(default_factory=list)
    """Ranks that never reported their data waits: their data loading is not measured."""

    @property
    def accounted(self) -> float:
        """Everything accounted (rank-seconds)."""
        return self.good + sum(self.badput.values())

    @property
    def ratio(self) -> float | None:
        """Goodput: good over everything accounted (None before anything is accounted)."""
        total = self.accounted
        return self.good / total if total > 0 else None

    @property
    def largest(self) -> str | None:
        """The badput kind with the most seconds (None while every kind is at 0)."""
        kind = max(KINDS, key=self.badput.__getitem__)
        return kind if self.badput[kind] > 0 else None


def job_goodput(ranks: Iterable[RankTime]) -> JobGoodput:
    """The job's figures from its ranks' (module docstring: the rules' definitions)."""
    job = JobGoodput()
    top_share = 0.0
    synchronous = True
    best: tuple[float, int] | None = None
    for r in ranks:
        job.good += r.good
        for kind, seconds in r.badput.items():
            job.badput[kind] += seconds
        total = r.accounted
        if total > 0:
            top_share = max(top_share, r.badput.get("data_loading", 0.0) / total)
        synchronous = synchronous and not r.straggling
        if (
            r.data_share is not None
            and r.data_share > 0
            and (best is None or r.data_share > best[0])
        ):
            best = (r.data_share, r.rank)
        if not r.data_measured:
            job.unmeasured.append(r.rank)
    if synchronous:
        wait = max(0.0, top_share * job.accounted - job.badput["data_loading"])
        wait = min(wait, job.good)
        job.collective_wait = wait
        job.good -= wait
        job.badput["data_loading"] += wait
    job.waits_on = None if best is None else best[1]
    return job
