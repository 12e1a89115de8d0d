"""Admission: who may hold a rank here, and what each tenant holds.

A tenant (:data:`~trainmon_exporter.state.rank.Tenant`) is the verified Kubernetes namespace
of a trainer's pod, else its uid. The node's caps (``max_ranks``, ``max_series``), each
tenant's quotas (``max_ranks_per_uid``, ``max_series_per_uid``, named after the uid they
applied to before namespaces were verified), the fair share of the node every tenant holding
less than it may claim back from the largest holders, the series budget every new rank,
custom name, layer and operation is charged to, eviction of disconnected ranks past retention
to make room, and the HELLOs turned away, counted by reason, namespace and uid.

:class:`Admission` belongs to one :class:`~trainmon_exporter.state.store.Store` and works
under its lock: the store tells it when a rank is added (:meth:`Admission.admit`) or
forgotten (:meth:`Admission.release`), a rank tells it when its connection ends (its
``on_gone``), and it hands the rank it evicts back to the store to forget.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping

from trainmon_client import _protocol as P
from trainmon_exporter.state.rank import RankState, Tenant, tenant_labels

SERIES_PER_RANK = 124
"""Series one rank costs in the exposition before any custom metric, operation, evaluation
value or layer: the rank budget of docs/scaling.md#cardinality-budget (127, measured with every
feature and one tracked operation) less that operation's 3."""
SERIES_PER_LAYER = len(P.LAYER_STATS) + len(P.LAYER_QUANTILES)
"""Series one exported layer costs at most (each statistic and gradient quantile)."""
SERIES_PER_OPERATION = 3
"""Series one tracked operation costs (seconds, count, active)."""
EVICTION_ORDER = ("finished", "failed", "crashed", "running")
"""Statuses of disconnected ranks in the order they are evicted to make room for a new one
(``running``: closed by the exporter, e.g. idle or at shutdown); oldest first within each."""
RECLAIMED = ("idle", "live")
"""How a connected rank was when it was taken from a tenant above its fair share: ``idle``
(no step since it connected), ``live`` (stepping). Keys of :attr:`Admission.evicted` beside
:data:`EVICTION_ORDER`."""
MAX_REFUSED_TENANTS = 64
"""Distinct ``(namespace, uid)`` label pairs of ``trainmon_ingest_hellos_refused_total``; the
HELLOs refused after them share ``uid="other"``."""

Queues = dict[str, OrderedDict[tuple[str, int], RankState]]
"""Disconnected ranks by status (:data:`EVICTION_ORDER`), each queue oldest first."""


class Admission:
    """The caps, quotas, fair shares, series budget and eviction queues of one store's ranks.

    The ranks (in the order they were admitted) and series each tenant holds, and the
    disconnected ranks in eviction order (one queue per status, globally and per tenant,
    oldest first), are kept indexed as ranks come and go, so admitting a rank is O(1) in the
    number of ranks until the node is full and a tenant below its fair share claims room
    (:meth:`_reclaim`, O(ranks) at worst).

    Tenancy: a tenant holds at most ``max_ranks_per_uid`` ranks and ``max_series_per_uid``
    series of the ``max_ranks`` and ``max_series`` of the node. A disconnected rank stays for
    at least ``retention_s`` whoever connects (its crash alert can fire); after that it may be
    evicted to make room, first by its own tenant. When the node is full and no disconnected
    rank is past retention, a tenant holding less than its fair share (the cap divided by the
    tenants that hold ranks, itself included) takes a rank from a tenant above it: a rank
    that has not stepped since it connected first (largest holder first), else the largest
    holder's most recently admitted connected rank. So a tenant that holds nothing always gets
    in, however many slots the others hold or squat.
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
        self.rank_quota = min(max_ranks, max_ranks_per_uid or max_ranks)
        self.series_quota = min(max_series, max_series_per_uid or max_series)
        self.retention_s = retention_s
        self.series_used = 0  # estimate of the rank series exported (see series_of)
        self.evicted: dict[str, int] = dict.fromkeys((*EVICTION_ORDER, *RECLAIMED), 0)
        # Indexes kept in step with the store's ranks (see admit and release).
        self.held: dict[Tenant, OrderedDict[tuple[str, int], RankState]] = {}
        self.tenant_series: dict[Tenant, int] = {}
        self.gone: Queues = {b: OrderedDict() for b in EVICTION_ORDER}
        self.gone_tenant: dict[Tenant, Queues] = {}
        self.hellos_refused: dict[tuple[str, str, str], int] = {}
        self.hellos_refused_at: dict[tuple[str, str, str], float] = {}  # same keys: latest, Unix s

    @property
    def tenant_ranks(self) -> dict[Tenant, int]:
        """Ranks each tenant holds (connected or not); O(tenants)."""
        return {t: len(held) for t, held in self.held.items()}

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

    def take_series(self, n: int, tenant: Tenant = None) -> bool:
        """Reserve ``n`` series for a rank of ``tenant``; False if they don't fit.

        They must fit both the node's budget (``max_series``) and the tenant's share of it
        (``max_series_per_uid``).
        """
        mine = self.tenant_series.get(tenant, 0)
        if self.series_used + n > self.max_series or mine + n > self.series_quota:
            return False
        self.series_used += n
        self.tenant_series[tenant] = mine + n
        return True

    def _free_series(self, n: int, tenant: Tenant) -> None:
        self.series_used = max(0, self.series_used - n)
        left = self.tenant_series.get(tenant, 0) - n
        if left > 0:
            self.tenant_series[tenant] = left
        else:
            self.tenant_series.pop(tenant, None)

    def recount_series(self) -> int:
        """Recompute :attr:`series_used` and each tenant's share from every state; under lock.

        Corrects drift. O(ranks): for the periodic expiry, never per HELLO.
        """
        per_tenant: dict[Tenant, int] = {}
        for s in self.ranks.values():
            per_tenant[s.tenant] = per_tenant.get(s.tenant, 0) + self.series_of(s)
        self.tenant_series = per_tenant
        self.series_used = sum(per_tenant.values())
        return self.series_used

    def count_refused_hello(self, reason: str, uid: int | None, namespace: str = "") -> None:
        """Count a HELLO turned away for ``reason``, by the peer that sent it.

        ``uid``: the peer's (``SO_PEERCRED``); ``namespace``: its pod's namespace as the node
        tells it (``""`` where there is none: never what the HELLO claims, which the sender
        chooses). The labels are bounded: the first :data:`MAX_REFUSED_TENANTS` pairs refused
        get their own values, later ones share ``uid="other"``; ``unknown`` is a peer the
        kernel gave no credentials for. Call under the store's lock.
        """
        label = "unknown" if uid is None else str(uid)
        key = (reason, namespace, label)
        if uid is not None and key not in self.hellos_refused:
            known = {(ns, u) for _, ns, u in self.hellos_refused if u not in ("other", "unknown")}
            if (namespace, label) not in known and len(known) >= MAX_REFUSED_TENANTS:
                key = (reason, "", "other")
        self.hellos_refused[key] = self.hellos_refused.get(key, 0) + 1
        self.hellos_refused_at[key] = time.time()

    def holdings(self, top: int) -> Iterator[tuple[str, str, int, int]]:
        """``(namespace, uid, ranks, series)`` of the ``top`` tenants holding most ranks.

        The tenants past them are summed into one row labelled ``uid="other"``. O(tenants
        log tenants); for scrapes, under the store's lock.
        """
        order = sorted(self.held, key=lambda t: len(self.held[t]), reverse=True)
        for t in order[:top]:
            ns, uid = tenant_labels(t)
            yield ns, uid, len(self.held[t]), self.tenant_series.get(t, 0)
        rest = order[top:]
        if rest:
            ranks = sum(len(self.held[t]) for t in rest)
            yield "", "other", ranks, sum(self.tenant_series.get(t, 0) for t in rest)

    # ------------------------------------------------------------------ the indexes

    def admit(self, state: RankState) -> None:
        """Count a new rank of the store (its series are already taken); queue it when it goes."""
        held = self.held.get(state.tenant)
        if held is None:
            held = self.held[state.tenant] = OrderedDict()
        held[state.key] = state
        state.on_gone = self._gone_now

    def _gone_now(self, state: RankState) -> None:
        """``state``'s connection ended: queue it for eviction (oldest first per status)."""
        bucket = state.status if state.status in self.gone else "running"
        self.gone[bucket][state.key] = state
        queues = self.gone_tenant.get(state.tenant)
        if queues is None:
            queues = self.gone_tenant[state.tenant] = {b: OrderedDict() for b in EVICTION_ORDER}
        queues[bucket][state.key] = state

    def unqueue(self, state: RankState) -> None:
        """Take ``state`` out of the eviction queues (it resumed or is removed)."""
        key = state.key
        for q in self.gone.values():
            if q.pop(key, None) is not None:
                break
        queues = self.gone_tenant.get(state.tenant)
        if queues is not None:
            for q in queues.values():
                if q.pop(key, None) is not None:
                    break
            if not any(queues.values()):
                del self.gone_tenant[state.tenant]

    def release(self, state: RankState) -> None:
        """Uncount a rank the store forgets: its place in the queues, its slot, its series."""
        self.unqueue(state)
        held = self.held.get(state.tenant)
        if held is not None:
            held.pop(state.key, None)
            if not held:
                del self.held[state.tenant]
        self._free_series(self.series_of(state), state.tenant)

    # ------------------------------------------------------------------ making room

    def make_room(self, tenant: Tenant, now: float) -> str | None:
        """Make room for a new rank of ``tenant`` and take its series; or say why not.

        The tenant's own quotas first, with its own disconnected ranks past retention as the
        only room (a quota equal to the node's cap is that cap); then the node's caps, with the
        tenant's own disconnected ranks first, then anyone's, past retention, and then, for a
        tenant below its fair share, a rank of a tenant above its own (:meth:`_reclaim`).
        Each step is O(1) but the last.
        """
        quota = self.rank_quota
        while quota < self.max_ranks and len(self.held.get(tenant, ())) >= quota:
            if not self._evict(tenant, False, now):
                return "uid_rank_quota"
        while len(self.ranks) >= self.max_ranks:
            if not (
                self._evict(tenant, False, now)
                or self._evict(tenant, True, now)
                or self._reclaim(tenant, False)
            ):
                return "too_many_ranks"
        share = self.series_quota
        while (
            share < self.max_series and self.tenant_series.get(tenant, 0) + SERIES_PER_RANK > share
        ):
            if not self._evict(tenant, False, now):
                return "uid_series_quota"
        while not self.take_series(SERIES_PER_RANK, tenant):
            if not (
                self._evict(tenant, False, now)
                or self._evict(tenant, True, now)
                or self._reclaim(tenant, True)
            ):
                return "series_budget"
        return None

    def _victim(self, tenant: Tenant, anyone: bool, now: float) -> RankState | None:
        """The disconnected rank to evict first: of ``tenant`` (or of anyone), past retention.

        First in :data:`EVICTION_ORDER`, oldest first within a status; a rank that left less
        than ``retention_s`` ago is never chosen. O(1): the head of at most four queues.
        """
        queues = self.gone if anyone else self.gone_tenant.get(tenant)
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

    def _evict(self, tenant: Tenant, anyone: bool, now: float) -> bool:
        """Evict :meth:`_victim`; False if there is none."""
        victim = self._victim(tenant, anyone, now)
        if victim is None:
            return False
        self._remove(victim)
        bucket = victim.status if victim.status in self.evicted else "running"
        self.evicted[bucket] += 1
        return True

    def _reclaim(self, tenant: Tenant, by_series: bool) -> bool:
        """Take one connected rank from a tenant above its fair share, for ``tenant`` below it.

        The fair share is the node's cap (``max_ranks``, or ``max_series`` with
        ``by_series``) divided among the tenants holding ranks, ``tenant`` included. Only a
        tenant whose new rank still fits its share may claim, and only from tenants above it:
        a rank with no step since it connected (squatting, or still loading) first, from the
        largest holder down, else the most recently admitted connected rank of the largest
        holder that has one. A disconnected rank within retention is never taken. The rank
        is forgotten and marked :attr:`RankState.revoked` (``evicted``): its connection is
        closed. Counted in :attr:`evicted` (:data:`RECLAIMED`). O(ranks) at worst.
        """
        if by_series:
            held: Mapping[Tenant, int] = self.tenant_series
            cap, need = self.max_series, SERIES_PER_RANK
        else:
            held, cap, need = self.tenant_ranks, self.max_ranks, 1
        fair = cap / (len(held) + (tenant not in held))
        if held.get(tenant, 0) + need > fair:
            return False
        over = sorted((t for t in held if t != tenant and held[t] > fair), key=held.__getitem__)
        over.reverse()  # the largest holder first
        ranks = [self.held[t] for t in over if t in self.held]
        victim = next((s for r in ranks for s in r.values() if _idle(s)), None)
        kind = "idle"
        if victim is None:
            kind = "live"
            victim = next((s for r in ranks for s in reversed(r.values()) if s.connected), None)
        if victim is None:
            return False
        self._remove(victim)
        victim.revoked = "evicted"
        self.evicted[kind] += 1
        return True


def _idle(state: RankState) -> bool:
    """A connected rank that has not stepped since it connected."""
    return state.connected and not state.stepping
