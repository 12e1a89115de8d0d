"""Admission: who may hold a rank here, and what each uid holds.

The node's caps (``max_ranks``, ``max_series``), each uid's quotas (``max_ranks_per_uid``,
``max_series_per_uid``), the series budget every new rank, custom name, layer and operation
is charged to, eviction of disconnected ranks past retention to make room, and the HELLOs
turned away, counted by uid. Every decision is O(1) in the ranks held.

:class:`Admission` belongs to one :class:`~trainmon_exporter.state.store.Store` and works
under its lock: the store tells it when a rank is added (:meth:`Admission.admit`) or
forgotten (:meth:`Admission.release`), a rank tells it when its connection ends (its
``on_gone``), and it hands the rank it evicts back to the store to forget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

from trainmon_client import _protocol as P
from trainmon_exporter.state.rank import RankState

SERIES_PER_RANK = 123
"""Series one rank costs in the exposition before any custom metric, operation, evaluation
value or layer: the rank budget of docs/scaling.md#cardinality-budget (126, measured with every
feature and one tracked operation) less that operation's 3."""
SERIES_PER_LAYER = len(P.LAYER_STATS) + len(P.LAYER_QUANTILES)
"""Series one exported layer costs at most (each statistic and gradient quantile)."""
SERIES_PER_OPERATION = 3
"""Series one tracked operation costs (seconds, count, active)."""
EVICTION_ORDER = ("finished", "failed", "crashed", "running")
"""Statuses of disconnected ranks in the order they are evicted to make room for a new one
(``running``: closed by the exporter, e.g. idle or at shutdown); oldest first within each."""
MAX_REFUSED_UIDS = 64
"""Distinct ``uid`` label values of ``trainmon_ingest_hellos_refused_total``; the uids
refused after them share ``uid="other"``."""

Queues = dict[str, OrderedDict[tuple[str, int], RankState]]
"""Disconnected ranks by status (:data:`EVICTION_ORDER`), each queue oldest first."""


class Admission:
    """The caps, quotas, series budget and eviction queues of one store's ranks.

    The ranks and series each uid holds, and the disconnected ranks in eviction order (one
    queue per status, globally and per uid, oldest first), are kept indexed as ranks come and
    go, so :meth:`make_room` is O(1) in the number of ranks.

    Tenancy: a uid holds at most ``max_ranks_per_uid`` ranks and ``max_series_per_uid``
    series of the ``max_ranks`` and ``max_series`` of the node, so one uid cannot take the
    slots or the series budget of the others. A disconnected rank stays for at least
    ``retention_s`` whoever connects (its crash alert can fire); after that it may be evicted
    to make room, first by its own uid.
    """

    def __init__(
        self,
        ranks: Mapping[tuple[str, int], RankState],
        remove: Callable[[RankState], None],
        *,
        max_ranks: int,
        max_series: int,
        max_ranks_per_uid: int | None,
        max_series_per_uid: int | None,
        retention_s: float,
    ) -> None:
        self.ranks = ranks  # the store's ranks, by key: read, never changed here
        self._remove = remove  # the store's way to forget a rank (one evicted here)
        self.max_ranks = max_ranks
        self.max_series = max_series
        self.max_ranks_per_uid = min(max_ranks, max_ranks_per_uid or max_ranks)
        self.max_series_per_uid = min(max_series, max_series_per_uid or max_series)
        self.retention_s = retention_s
        self.series_used = 0  # estimate of the rank series exported (see series_of)
        self.evicted: dict[str, int] = dict.fromkeys(EVICTION_ORDER, 0)
        # Indexes kept in step with the store's ranks (see admit and release).
        self.uid_ranks: dict[int | None, int] = {}
        self.uid_series: dict[int | None, int] = {}
        self.gone: Queues = {b: OrderedDict() for b in EVICTION_ORDER}
        self.gone_uid: dict[int | None, Queues] = {}
        self.hellos_refused: dict[tuple[str, str], int] = {}

    @staticmethod
    def series_of(state: RankState) -> int:
        """Series ``state`` costs in the exposition (an upper-bound estimate)."""
        return (
            SERIES_PER_RANK
            + len(state.custom)
            + len(state.eval_values)
            + SERIES_PER_OPERATION * len(state.ops)
            + SERIES_PER_LAYER * len(state.layers)
        )

    def take_series(self, n: int, uid: int | None = None) -> bool:
        """Reserve ``n`` series for a rank of ``uid``; False if they don't fit.

        They must fit both the node's budget (``max_series``) and the uid's share of it
        (``max_series_per_uid``).
        """
        mine = self.uid_series.get(uid, 0)
        if self.series_used + n > self.max_series or mine + n > self.max_series_per_uid:
            return False
        self.series_used += n
        self.uid_series[uid] = mine + n
        return True

    def _free_series(self, n: int, uid: int | None) -> None:
        self.series_used = max(0, self.series_used - n)
        left = self.uid_series.get(uid, 0) - n
        if left > 0:
            self.uid_series[uid] = left
        else:
            self.uid_series.pop(uid, None)

    def recount_series(self) -> int:
        """Recompute :attr:`series_used` and each uid's share from every state; under lock.

        Corrects drift. O(ranks): for the periodic expiry, never per HELLO.
        """
        per_uid: dict[int | None, int] = {}
        for s in self.ranks.values():
            per_uid[s.owner_uid] = per_uid.get(s.owner_uid, 0) + self.series_of(s)
        self.uid_series = per_uid
        self.series_used = sum(per_uid.values())
        return self.series_used

    def count_refused_hello(self, reason: str, uid: int | None) -> None:
        """Count a HELLO turned away for ``reason``, by the uid that sent it.

        The ``uid`` label is bounded: the first :data:`MAX_REFUSED_UIDS` uids refused get
        their own value, later ones share ``other``; ``unknown`` is a peer the kernel gave no
        credentials for. Call under the store's lock.
        """
        label = "unknown" if uid is None else str(uid)
        key = (reason, label)
        if uid is not None and key not in self.hellos_refused:
            known = self._refused_uids()
            if label not in known and len(known) >= MAX_REFUSED_UIDS:
                key = (reason, "other")
        self.hellos_refused[key] = self.hellos_refused.get(key, 0) + 1

    def _refused_uids(self) -> set[str]:
        return {u for _, u in self.hellos_refused if u not in ("other", "unknown")}

    # ------------------------------------------------------------------ the indexes

    def admit(self, state: RankState) -> None:
        """Count a new rank of the store (its series are already taken); queue it when it goes."""
        self.uid_ranks[state.owner_uid] = self.uid_ranks.get(state.owner_uid, 0) + 1
        state.on_gone = self._gone_now

    def _gone_now(self, state: RankState) -> None:
        """``state``'s connection ended: queue it for eviction (oldest first per status)."""
        bucket = state.status if state.status in self.gone else "running"
        self.gone[bucket][state.key] = state
        queues = self.gone_uid.get(state.owner_uid)
        if queues is None:
            queues = self.gone_uid[state.owner_uid] = {b: OrderedDict() for b in EVICTION_ORDER}
        queues[bucket][state.key] = state

    def unqueue(self, state: RankState) -> None:
        """Take ``state`` out of the eviction queues (it resumed or is removed)."""
        key = state.key
        for q in self.gone.values():
            if q.pop(key, None) is not None:
                break
        queues = self.gone_uid.get(state.owner_uid)
        if queues is not None:
            for q in queues.values():
                if q.pop(key, None) is not None:
                    break
            if not any(queues.values()):
                del self.gone_uid[state.owner_uid]

    def release(self, state: RankState) -> None:
        """Uncount a rank the store forgets: its place in the queues, its slot, its series."""
        self.unqueue(state)
        left = self.uid_ranks.get(state.owner_uid, 0) - 1
        if left > 0:
            self.uid_ranks[state.owner_uid] = left
        else:
            self.uid_ranks.pop(state.owner_uid, None)
        self._free_series(self.series_of(state), state.owner_uid)

    # ------------------------------------------------------------------ making room

    def make_room(self, uid: int | None, now: float) -> str | None:
        """Make room for a new rank of ``uid`` and take its series; or say why not.

        The uid's own quotas first, with its own disconnected ranks past retention as the only
        room (a quota equal to the node's cap is that cap); then the node's caps, with the
        uid's own ranks first, then anyone's, past retention. Each step is O(1).
        """
        quota = self.max_ranks_per_uid
        while quota < self.max_ranks and self.uid_ranks.get(uid, 0) >= quota:
            if not self._evict(uid, False, now):
                return "uid_rank_quota"
        while len(self.ranks) >= self.max_ranks:
            if not (self._evict(uid, False, now) or self._evict(uid, True, now)):
                return "too_many_ranks"
        share = self.max_series_per_uid
        while share < self.max_series and self.uid_series.get(uid, 0) + SERIES_PER_RANK > share:
            if not self._evict(uid, False, now):
                return "uid_series_quota"
        while not self.take_series(SERIES_PER_RANK, uid):
            if not (self._evict(uid, False, now) or self._evict(uid, True, now)):
                return "series_budget"
        return None

    def _victim(self, uid: int | None, anyone: bool, now: float) -> RankState | None:
        """The disconnected rank to evict first: of ``uid`` (or of anyone), past retention.

        First in :data:`EVICTION_ORDER`, oldest first within a status; a rank that left less
        than ``retention_s`` ago is never chosen. O(1): the head of at most four queues.
        """
        queues = self.gone if anyone else self.gone_uid.get(uid)
        if queues is None:
            return None
        horizon = now - self.retention_s
        for bucket in EVICTION_ORDER:
            q = queues[bucket]
            if q:
                s = next(iter(q.values()))
                if s.left_mono is None or s.left_mono <= horizon:
                    return s
        return None

    def _evict(self, uid: int | None, anyone: bool, now: float) -> bool:
        """Evict :meth:`_victim`; False if there is none."""
        victim = self._victim(uid, anyone, now)
        if victim is None:
            return False
        self._remove(victim)
        bucket = victim.status if victim.status in self.evicted else "running"
        self.evicted[bucket] += 1
        return True
