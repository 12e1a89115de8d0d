"""The store: every rank state, the lock, and the records applied under the store's limits.

:class:`Store` indexes the ranks by (run, rank) and by run, binds each new connection to its
rank (:meth:`Store.attach`: ownership, owner claims, resuming), applies the records that need
the store's limits (custom metrics, layers, operations, charged to the series budget of its
:class:`~trainmon_exporter.state.admission.Admission`), expires ranks past the TTL and runs the
periodic judgement. A rank's own figures change in :class:`~trainmon_exporter.state.rank.RankState`.
What outlives a rank (its accounting past expiry) is :attr:`Store.ledger`'s: the store tells
it when a rank leaves (:meth:`Store._remove`) and asks it when one comes back (:meth:`attach`).
A hung rank's evidence is :attr:`Store.hangs`'s: the store takes its lock and delegates.

Why this module is one module of about 560 lines: :meth:`Store.attach` decides who a connection
is bound to (owner claims, the tenant that owns a run, a namespace's pods over a process that
only named it, resuming a rank, adopting a departed rank's accounting), and every one of those
rules reads and changes the same indexes; split, each part would need all of them.

:mod:`trainmon_exporter.apply` calls the store from the ingest server's thread; collectors and
the JSON API (worker threads) read. Both sides hold :attr:`Store.lock` for the duration of one
slice of a packet's records or one snapshot.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Container, Iterator, Mapping
from typing import Any

from trainmon_client import _protocol as P
from trainmon_exporter.analytics import RankAnalytics, RunAnalytics
from trainmon_exporter.analytics.goodput import Goodput
from trainmon_exporter.claims import OwnerClaims
from trainmon_exporter.settings import AnalyticsSettings
from trainmon_exporter.state.admission import SERIES_PER_LAYER, SERIES_PER_OPERATION, Admission
from trainmon_exporter.state.evidence import HangEvidence
from trainmon_exporter.state.ledger import FileStats, Ledger
from trainmon_exporter.state.rank import (
    WATCH_OPERATION,
    Drop,
    Operation,
    RankState,
    Tenant,
    clock,
    run_key,
    tenant_labels,
    tenant_of,
)

RANK_CHUNK = 8
"""Ranks a scrape reads per hold of :attr:`Store.lock` (see :meth:`Store.iter_ranks`)."""
_RESUMED_FIELDS = tuple(k for k in P.HELLO_FIELDS if k not in ("run", "rank", "namespace"))
"""HELLO fields a resumed rank takes from its new HELLO: all but its identity."""


class Store:
    """All rank states, with the lock that serialises ingest against scrapes.

    Admission (:meth:`attach`) is O(1) in the number of ranks: the ranks of each run are kept
    indexed here, and what each tenant holds and the eviction queues by :attr:`admission`, as
    ranks come and go. The caps, quotas, fair shares, retention and series budget are
    :attr:`admission`'s (:class:`~trainmon_exporter.state.admission.Admission`).

    A run belongs to the tenant that opened it (:data:`~trainmon_exporter.state.rank.Tenant`:
    the verified namespace of its pod, else its uid), or to the uid its owner claim names. Its
    owner is remembered past the eviction of its last rank in a table bounded per tenant
    (``4 × max_ranks_per_uid`` runs), so another tenant's churn cannot push it out.

    Runs are keyed by :func:`run_key`: a client in a Kubernetes namespace has its own runs.
    ``default_namespace`` is the namespace of a client that reports none (the exporter's own in
    a DaemonSet, which Prometheus gives such series), so runs are keyed as they are labelled.
    """

    def __init__(
        self,
        *,
        analytics: AnalyticsSettings | None = None,
        max_ranks: int,
        max_custom_metrics: int,
        buckets: tuple[float, ...],
        max_layers: int = 128,
        layer_ranks: Container[int] = range(1),
        window_s: float,
        ttl_s: float,
        max_series: int = 1 << 62,
        max_operations: int = 64,
        max_ranks_per_uid: int | None = None,
        max_series_per_uid: int | None = None,
        retention_s: float = 0.0,
        default_namespace: str = "",
        goodput_retention_s: float = 86_400.0,
        capture_max_bytes: int = 32768,
        evidence_max_bytes: int = 4 * 2**20,
    ) -> None:
        self.lock = threading.Lock()
        self.default_namespace = default_namespace
        self.ranks: dict[tuple[str, int], RankState] = {}
        self.max_operations = max_operations
        # The ranks of each run, kept in step with self.ranks (see _add and _remove).
        self._runs: dict[str, dict[int, RankState]] = {}
        self.admission = Admission(
            self.ranks,
            self._remove,
            max_ranks=max_ranks,
            max_series=max_series,
            max_ranks_per_uid=max_ranks_per_uid,
            max_series_per_uid=max_series_per_uid,
            retention_s=min(retention_s, ttl_s),
        )
        # run -> (owner tenant, monotonic time the record lapses): runs whose every rank was
        # evicted keep their owner until the series TTL, so their id cannot be taken over.
        # Bounded per tenant (_owner_runs), oldest first, never by another tenant's records.
        self.owners: OrderedDict[str, tuple[Tenant, float]] = OrderedDict()
        self._owner_runs: dict[Tenant, OrderedDict[str, None]] = {}
        self.max_owner_records = 4 * self.admission.rank_quota
        # The owner claims consulted at every HELLO (a run's uid, registered by a privileged
        # process such as the Slurm prolog); None: no claims.
        self.claims: OwnerClaims | None = None
        self.max_custom_metrics = max_custom_metrics
        self.max_layers = max_layers
        self.layer_ranks = layer_ranks  # ranks whose layers are exported as series
        self.buckets = buckets
        self.window_s = window_s
        self.ttl_s = ttl_s
        self.expired_total = 0
        self.analytics = analytics or AnalyticsSettings()
        self.judge = RunAnalytics()  # the periodic judgement (check_conditions)
        # The accounting of ranks that left without a clean finish (at most max_ranks).
        self.ledger = Ledger(max_ranks, goodput_retention_s)
        self.file_stats = FileStats()  # the state file's, kept by its Keeper
        self.hangs = HangEvidence(capture_max_bytes, evidence_max_bytes)
        """The hung ranks' evidence: requests, answers, the byte bound (state/evidence.py)."""

    def iter_ranks(self, chunk: int = RANK_CHUNK) -> Iterator[RankState]:
        """Every rank state, holding :attr:`lock` for at most ``chunk`` ranks at a time.

        For scrapes and the JSON API: the caller copies what it needs from each state as it
        gets it (the lock is held meanwhile), and between chunks the lock is free, so ingest
        waits at most one chunk's worth (about a millisecond), never a whole scrape. Ranks
        added meanwhile appear in the next scrape; one removed meanwhile may appear once more.
        Consume it in full (a ``for`` loop; an early ``break`` releases the lock when the
        generator is closed).
        """
        with self.lock:
            states = list(self.ranks.values())
        for i in range(0, len(states), chunk):
            with self.lock:
                yield from states[i : i + chunk]
            time.sleep(0)  # let a waiting ingest thread take the lock (and the GIL) now

    # ------------------------------------------------------------------ the indexes

    def _add(self, state: RankState) -> None:
        """Index a new rank (its series are already taken)."""
        self.ranks[state.key] = state
        self._runs.setdefault(state.run_key, {})[state.rank] = state
        self.admission.admit(state)

    def _remove(self, state: RankState, *, remember: bool = True, depart: bool = True) -> None:
        """Forget a rank; if it was its run's last, remember the run's owner until the TTL.

        ``depart``: its time accounting goes to :attr:`ledger` (unless it finished cleanly).
        """
        key = state.key
        if depart:
            self.ledger.keep(state, time.monotonic())
        del self.ranks[key]
        self.admission.release(state)
        self.hangs.forget(state)
        state.on_gone = None
        run_ranks = self._runs[state.run_key]
        del run_ranks[state.rank]
        if run_ranks:
            return
        del self._runs[state.run_key]
        now = time.monotonic()
        lapse = (state.disconnected_mono or now) + self.ttl_s
        if remember and lapse > now:
            self._remember_owner(state.run_key, state.tenant, lapse)

    def _remember_owner(self, run: str, tenant: Tenant, lapse: float) -> None:
        self._forget_owner(run)
        self.owners[run] = (tenant, lapse)
        mine = self._owner_runs.setdefault(tenant, OrderedDict())
        mine[run] = None
        while len(mine) > self.max_owner_records:  # the tenant's own oldest record goes
            old, _ = mine.popitem(last=False)
            self.owners.pop(old, None)

    def _forget_owner(self, run: str) -> None:
        entry = self.owners.pop(run, None)
        if entry is not None:
            mine = self._owner_runs.get(entry[0])
            if mine is not None:
                mine.pop(run, None)
                if not mine:
                    del self._owner_runs[entry[0]]

    def key_of(self, namespace: str, run: str) -> str:
        """The key of ``run`` from a client that reported ``namespace`` (``""``: none)."""
        return run_key(namespace or self.default_namespace, run)

    def run_state(self, run: str) -> RankState | None:
        """Any one rank of ``run`` (they share its owner), or None when it has no state."""
        ranks = self._runs.get(run)
        return next(iter(ranks.values())) if ranks else None

    def owner_of(self, run: str) -> Tenant:
        """Who owns ``run`` (a key) now: its owner claim's uid, else its ranks' or record's tenant.

        None: nobody, or a peer of unknown uid.
        """
        claimed = self._claimed(run)
        if claimed is not None:
            return claimed
        holder = self.run_state(run)
        if holder is not None:
            return holder.tenant
        entry = self.owners.get(run)
        return None if entry is None else entry[0]

    def attach(
        self,
        hello: dict[str, Any],
        uid: int | None = None,
        pid: int | None = None,
        peer_namespace: str = "",
    ) -> RankState | str:
        """Bind a new connection to its (run, rank) state, creating or resuming it.

        ``uid`` and ``pid`` are the connecting process's (``SO_PEERCRED``; ``pid`` in the
        exporter's PID namespace, kept as :attr:`RankState.peer_pid`); ``peer_namespace`` the
        namespace of its pod as the node tells it (``""``: none known), which the HELLO's
        namespace must already be (:mod:`trainmon_exporter.apply` checks). The connection's
        tenant is that namespace, else the uid. A run belongs to the tenant that opened it for
        as long as any of its ranks has state here (until the last one expires): another
        tenant, root included, can neither add a rank nor resume one, nor pre-empt a live one.
        A namespace's verified pods outrank a process that only claimed that namespace: ranks
        such a process opened there are dropped when one of its pods connects to that run.

        Returns the state, or a refusal reason: ``not_owner`` (the run belongs to another
        tenant, or its owner claim names another uid), ``duplicate_rank`` (that rank is already
        connected), ``uid_rank_quota`` (the tenant holds ``max_ranks_per_uid`` ranks and none
        of its own is past retention), ``too_many_ranks`` (``max_ranks`` reached, none past
        retention, and the tenant at its fair share), ``uid_series_quota`` (the tenant's share
        of the series budget is spent) or ``series_budget`` (``max_series`` spent). A rank that
        reconnects after a crash or a lost connection keeps its exporter-side counters (the
        run resumed under the same id); one that had finished cleanly starts from fresh state
        (the id was reused for a new run).
        """
        hello = {"namespace": "", "pod": "", **hello}  # a client off Kubernetes sends neither
        hello["namespace"] = hello["namespace"] or self.default_namespace
        run = run_key(hello["namespace"], hello["run"])
        key = (run, hello["rank"])
        tenant = tenant_of(peer_namespace, uid)
        state = self.ranks.get(key)
        holder = state if state is not None else self.run_state(run)
        claimed = self._claimed(run)
        if claimed is not None:
            if claimed != uid:
                return "not_owner"
            if holder is not None and holder.owner_uid != uid:
                self._revoke(run)  # opened by another uid before the claim: a squatter
                state = holder = None
        elif holder is not None and peer_namespace and not isinstance(holder.tenant, str):
            self._revoke(run)  # opened by a process that only claimed this pod's namespace
            state = holder = None
        if holder is not None and holder.tenant != tenant:
            return "not_owner"
        now = time.monotonic()
        if holder is None and run in self.owners:
            owner, lapse = self.owners[run]
            outranked = bool(peer_namespace) and not isinstance(owner, str)
            if lapse > now and owner != tenant and claimed is None and not outranked:
                return "not_owner"  # its ranks were evicted; the id is still its owner's
            self._forget_owner(run)
        if state is not None and not state.connected and state.status == "finished":
            # A rank that finished cleanly, opened again: a new run under a used id. Nothing
            # of the old one carries over (its loss level would read as spikes); the counters
            # start again at 0, a reset rate() and increase() handle.
            self._remove(state, remember=False)
            state = None
        if state is not None:
            if state.connected:
                return "duplicate_rank"
            self.admission.unqueue(state)
            state.connected = True
            state.status = "running"
            state.connected_mono = now
            state.disconnected_mono = state.left_mono = None
            state.connections += 1
            for op in state.ops.values():
                op.active = False  # a new process runs no operation yet
            same = hello["pid"] == state.pid and hello["started_at"] == state.started_at
            state.goodput.reconnect(hello["started_at"], now, time.time() - now, same)
            for k in _RESUMED_FIELDS:
                setattr(state, k, hello[k])
            state.peer_pid = pid
            return state
        refusal = self.admission.make_room(tenant, now)
        if refusal is not None:
            return refusal
        offset = time.time() - now
        if holder is None and any(d.tenant != tenant for d in self.ledger.of_run(run)):
            self.ledger.forget_run(run)  # another tenant's run of old: this is a new run
        record = self.ledger.take(key)
        state = RankState(
            **{k: hello[k] for k in P.HELLO_FIELDS},
            buckets=self.buckets,
            analytics=RankAnalytics(self.analytics),
            goodput=(
                Goodput.start(hello["started_at"], now, offset)
                if record is None
                else record.goodput
            ),
        )
        if record is not None:  # it comes back after its state expired: its accounting goes on
            state.step, state.steps_total = record.step, record.steps_total
            same = record.hello["pid"] == hello["pid"] and (
                record.hello["started_at"] == hello["started_at"]
            )
            state.goodput.reconnect(hello["started_at"], now, offset, same)
        state.owner_uid = uid
        state.tenant = tenant
        state.peer_pid = pid
        self._add(state)
        return state

    def _claimed(self, run: str) -> int | None:
        """The uid an owner claim names for the run id of the key ``run``, in any namespace.

        Claims name run ids (the Slurm prolog's ``slurm-<job id>``): a client in a namespace
        (slurmd in a pod passes its service account's on) is held to its run id's claim too.
        """
        if self.claims is None:
            return None
        return self.claims.lookup(run.rpartition("/")[2])

    def _revoke(self, run: str) -> None:
        """Forget every rank of ``run``: its owner claim or its namespace names another owner.

        Each is marked :attr:`RankState.revoked`, so a connection still bound to it is closed
        (refused ``not_owner``, counted by its uid and namespace).
        """
        for state in list(self._runs.get(run, {}).values()):
            self._remove(state, remember=False, depart=False)
            state.revoked = "not_owner"
            namespace, _ = tenant_labels(state.tenant)
            self.admission.count_refused_hello("not_owner", state.owner_uid, namespace)

    # ------------------------------------------------------------------ applying records

    def observe_step(
        self, state: RankState, record: P.Step, names: Mapping[int, str], drop: Drop
    ) -> None:
        """Apply a STEP record to ``state`` (:meth:`RankState.observe_step`).

        New custom names are charged to the series budget; those that do not fit are removed
        again (``series_budget``).
        """
        n = len(state.custom)
        state.observe_step(record, names, self.window_s, self.max_custom_metrics, drop)
        if len(state.custom) > n:
            self._charge(state, state.custom, len(state.custom) - n, 1, drop)

    def observe_layers(
        self, state: RankState, record: P.Layers, names: Mapping[int, str], drop: Drop
    ) -> None:
        """Apply a LAYERS record: its layers, and the ``watch`` operation (checks and cost).

        The layers go to :meth:`RankState.observe_layers`. Only ranks in ``layer_ranks``
        keep their layers, at most ``max_layers``, each charged to the series budget.
        """
        n = len(state.layers)
        state.observe_layers(
            [names.get(i) for i in record.ids],
            record.codes,
            record.values,
            self.max_layers,
            state.rank in self.layer_ranks,
            drop,
        )
        if len(state.layers) > n:
            self._charge(state, state.layers, len(state.layers) - n, SERIES_PER_LAYER, drop)
        head = record.header
        self._operation(state, WATCH_OPERATION, head.seconds_total, head.checks_total, False, drop)

    def observe_eval(
        self, state: RankState, record: P.Eval, names: Mapping[int, str], drop: Drop
    ) -> None:
        """Apply an EVAL record: its validation loss and its named values.

        The validation loss is field ``loss`` or ``val_loss``. Named values are capped like
        custom metrics (``custom_cap``) and charged to the series budget (``series_budget``).
        """
        val_loss = None
        values = state.eval_values
        for fid, v in zip(record.ids, record.values, strict=True):
            if fid == P.FIELD_LOSS or fid == P.FIELD_VAL_LOSS:  # either is the validation loss
                val_loss = v
                continue
            name = names.get(fid)
            if name is None:
                drop("unknown_field", 1)
            elif name in values:
                values[name] = v
            elif len(values) >= self.max_custom_metrics:
                drop("custom_cap", 1)
            elif self.admission.take_series(1, state.tenant):
                values[name] = v
            else:
                drop("series_budget", 1)
        state.eval_step = record.step
        mono, offset = clock()
        state.phase_end_mono = mono
        state.goodput.evaluation(record.time - offset, mono)
        if val_loss is not None:
            values["val_loss"] = val_loss
        state.analytics.observe_eval(val_loss)

    def observe_track(
        self, state: RankState, record: P.Track, names: Mapping[int, str], drop: Drop
    ) -> bool:
        """Apply a TRACK record; False (and ``unknown_field``) when its name id is unbound."""
        name = names.get(record.field_id)
        if name is None:
            drop("unknown_field", 1)
            return False
        self._operation(state, name, record.seconds_total, record.runs_total, record.active, drop)
        return True

    def _operation(
        self,
        state: RankState,
        name: str,
        seconds_total: float,
        runs_total: int,
        active: bool,
        drop: Drop,
    ) -> None:
        """Set operation ``name`` of ``state``.

        A new name needs room under ``max_operations`` (``operation_cap``) and in the series
        budget (``series_budget``).
        """
        now = time.monotonic()
        state.goodput.operation(name, seconds_total, now)
        if not active:
            state.phase_end_mono = now  # the hang clock starts again after an operation
        op = state.ops.get(name)
        if op is not None:
            op.seconds_total, op.runs_total, op.active = seconds_total, runs_total, active
            return
        if len(state.ops) >= self.max_operations:
            drop("operation_cap", 1)
        elif not self.admission.take_series(SERIES_PER_OPERATION, state.tenant):
            drop("series_budget", 1)
        else:
            state.ops[name] = Operation(seconds_total, runs_total, active)

    def _charge(
        self, state: RankState, table: dict[str, Any], added: int, cost: int, drop: Drop
    ) -> None:
        """Charge ``added`` entries just inserted into ``table`` to the series budget.

        Each costs ``cost`` series; the newest that do not fit are removed again and counted
        (``series_budget``).
        """
        refused = 0
        while added and not self.admission.take_series(added * cost, state.tenant):
            table.popitem()  # dicts keep insertion order: the newest name goes
            added -= 1
            refused += 1
        if refused:
            drop("series_budget", refused)

    def admit_restored(self, state: RankState, now: float) -> bool:
        """Index ``state``, a disconnected rank read back from the state file, under the lock.

        Admitted like a new rank, then queued for eviction and expiry from ``now``. False when
        its key is taken or the node's caps do not hold it.
        """
        if state.key in self.ranks or self.admission.make_room(state.owner_uid, now) is not None:
            return False
        self._add(state)
        if state.on_gone is not None:
            state.on_gone(state)
        return True

    # ------------------------------------------------------------------ hang evidence

    def begin_capture(self, state: RankState, now_mono: float | None = None) -> int:
        """A hang episode of ``state`` starts: its request id (:meth:`HangEvidence.begin`)."""
        with self.lock:
            return self.hangs.begin(state, time.monotonic() if now_mono is None else now_mono)

    def capture_not_sent(self, state: RankState, why: str) -> None:
        """The request could not be sent (``why``): no answer (:meth:`HangEvidence.not_sent`)."""
        with self.lock:
            self.hangs.not_sent(state, why)

    def expire_captures(self, timeout_s: float, now_mono: float | None = None) -> list[RankState]:
        """Requests unanswered after ``timeout_s`` become ``no_answer``; those ranks."""
        with self.lock:
            now = time.monotonic() if now_mono is None else now_mono
            return self.hangs.expire(timeout_s, now)

    def observe_capture(self, state: RankState, record: P.Capture) -> bool:
        """Apply a CAPTURE of ``state``'s connection (:meth:`HangEvidence.observe`)."""
        return self.hangs.observe(state, record)

    def set_native(self, state: RankState, request_id: int, text: str | None, note: str) -> None:
        """py-spy's native stacks of the episode, or why none (:meth:`HangEvidence.native`)."""
        with self.lock:
            if state.key in self.ranks:
                self.hangs.native(state, request_id, text, note)

    def expire(self, now_mono: float | None = None) -> int:
        """Drop ranks disconnected for longer than the TTL. Returns how many were dropped.

        A rank the exporter closed (idle, or at shutdown) counts from when it closed it.
        O(ranks dropped): the eviction queues hold disconnected ranks oldest first.
        """
        now_mono = time.monotonic() if now_mono is None else now_mono
        n = 0
        with self.lock:
            for q in self.admission.gone.values():
                while q:
                    s = next(iter(q.values()))
                    left = s.left_mono if s.left_mono is not None else now_mono
                    if now_mono - left < self.ttl_s:
                        break  # the oldest of this status is not due yet
                    self._remove(s, remember=False)
                    n += 1
            self.expired_total += n
            self.ledger.expire(now_mono)
            while self.owners:
                run, (_owner, lapse) = next(iter(self.owners.items()))
                if lapse > now_mono:
                    break
                self._forget_owner(run)
            self.admission.recount_series()
        return n

    def check_conditions(
        self, now_mono: float | None = None, rates: bool = True
    ) -> list[tuple[RankState, str]]:
        """Judge the time-based detectors of every rank, under the lock.

        ``now_mono``: ``time.monotonic()`` s (now by default), the clock hangs are judged on.

        :meth:`RunAnalytics.check <trainmon_exporter.analytics.RunAnalytics.check>`: hangs
        always; with ``rates`` also throughput drops, memory leaks and stragglers.

        Returns the ``(rank, kind)`` episodes that just started.
        """
        with self.lock:
            now_mono = time.monotonic() if now_mono is None else now_mono
            ranks = list(self.ranks.values())
            started = self.judge.check(ranks, now_mono, rates=rates)
            for s in ranks:
                if s.analytics.hung and s.connected:
                    # a hang is accounted as it lasts, from where the step should have ended
                    s.goodput.hung(now_mono, s.analytics.median_interval())
            return started
