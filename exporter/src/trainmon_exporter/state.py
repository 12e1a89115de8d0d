"""Push-side state: what the exporter knows about every (run, rank), updated per record.

Why this module is one module of about 700 lines: it is the one owner of every change to a
rank (observe a step, layers, an evaluation, an operation, a checkpoint, totals; finish,
disconnect) and of the store's caps, series budget and eviction, which must see those changes
under one lock. Judgement is elsewhere (:mod:`trainmon_exporter.analytics`, :mod:`derive`).

Every change to a rank's state is made here: :class:`Store` applies a record under its limits
(custom metrics, layers, operations, the series budget) and :class:`RankState` keeps the
rank's figures. :mod:`trainmon_exporter.apply` calls them from the ingest server's thread;
collectors and the JSON API (worker threads) read. Both sides hold :attr:`Store.lock` for the
duration of one packet or one snapshot.

Values a record carries that cannot be kept are reported to a :data:`Drop` callable with
their reason (a ``reason`` of ``trainmon_ingest_values_dropped_total``), never raised.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable, Container, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from trainmon_client import _protocol as P
from trainmon_exporter.analytics import RankAnalytics, RunAnalytics
from trainmon_exporter.analytics.goodput import Goodput
from trainmon_exporter.claims import OwnerClaims
from trainmon_exporter.settings import AnalyticsSettings

NONFINITE_FIELDS = ("loss", "grad_norm", "lr", "custom")
"""``field`` label values of ``trainmon_train_nonfinite_values_total``; ``custom`` sums every
custom metric, so each series exists at 0 from a rank's first message."""
STATUSES = ("running", "finished", "failed", "crashed")
SERIES_PER_RANK = 121
"""Series one rank costs in the exposition before any custom metric, operation, evaluation
value or layer: the rank budget of docs/scaling.md#cardinality-budget (124, measured with every
feature and one tracked operation) less that operation's 3."""
SERIES_PER_LAYER = len(P.LAYER_STATS) + len(P.LAYER_QUANTILES)
"""Series one exported layer costs at most (each statistic and gradient quantile)."""
SERIES_PER_OPERATION = 3
"""Series one tracked operation costs (seconds, count, active)."""
EVICTION_ORDER = ("finished", "failed", "crashed", "running")
"""Statuses of disconnected ranks in the order they are evicted to make room for a new one
(``running``: closed by the exporter, e.g. idle or at shutdown); oldest first within each."""
RANK_CHUNK = 8
"""Ranks a scrape reads per hold of :attr:`Store.lock` (see :meth:`Store.iter_ranks`)."""
_RESUMED_FIELDS = tuple(k for k in P.HELLO_FIELDS if k not in ("run", "rank", "namespace"))
"""HELLO fields a resumed rank takes from its new HELLO: all but its identity."""


def run_key(namespace: str, run: str) -> str:
    """The run as the store keys it: ``namespace/run`` in a Kubernetes namespace, else the id.

    A run id has no ``/``, so the two forms never meet, and one namespace's run never shares
    state, owner or ranks with another namespace's run of the same id.
    """
    return f"{namespace}/{run}" if namespace else run


HISTORY_STEPS = 240
"""Logged steps each rank keeps for the views' sparklines (:attr:`RankState.history`)."""
MAX_REFUSED_UIDS = 64
"""Distinct ``uid`` label values of ``trainmon_ingest_hellos_refused_total``; the uids
refused after them share ``uid="other"``."""
LAYER_STAT_CODES = frozenset(
    (*P.LAYER_STATS.values(), *(P.QUANTILE_CODE0 + i for i in range(len(P.LAYER_QUANTILES))))
)
"""Stat codes a LAYERS record may carry; values under any other code are dropped
(``unknown_stat``), never stored."""
_FIELD_DATA_TIME = P.FIELD_DATA_TIME
"""Field id of a step's input wait (s), for the time accounting (:mod:`.analytics.goodput`)."""
WATCH_OPERATION = "watch"
"""Operation name of a rank's ``Run.watch`` checks (from its LAYERS records)."""

Drop = Callable[[str, int], None]
"""Told ``(reason, n)`` when ``n`` values of a record are not kept (``n`` > 0)."""


def ignore_drops(reason: str, n: int) -> None:
    """A :data:`Drop` that forgets what it is told."""


_OFFSET_EVERY_S = 1.0
"""How often :func:`wall_offset` reads the wall clock again (s of monotonic time)."""
_offset = [-math.inf, 0.0]  # [monotonic time it was read, wall minus monotonic]


def wall_offset(mono: float) -> float:
    """Wall-clock minus monotonic time, read again at most every :data:`_OFFSET_EVERY_S`.

    It maps a client's wall-clock time (same host) onto the monotonic clock the time
    accounting uses (:mod:`trainmon_exporter.analytics.goodput`). Reading both clocks costs
    about 2 us where they are not in the vDSO (some VMs): once a second, not once a step.
    """
    cache = _offset
    if mono - cache[0] >= _OFFSET_EVERY_S or mono < cache[0]:
        now = time.monotonic()
        cache[0], cache[1] = now, time.time() - now
    return cache[1]


def clock() -> tuple[float, float]:
    """Now on ``time.monotonic()``, and :func:`wall_offset`."""
    mono = time.monotonic()
    return mono, wall_offset(mono)


@dataclass(slots=True)
class Operation:
    """A rank's tracked operation (``Run.track``, or its ``Run.watch`` checks), cumulative."""

    seconds_total: float
    """Wall time of its finished runs (s)."""
    runs_total: int
    """Its finished runs."""
    active: bool = False
    """Whether it runs now."""


@dataclass(slots=True)
class WindowPoint:
    """One step's cumulative totals, for rates over ``rate_window_seconds``."""

    time: float
    tokens: float
    samples: float
    overhead: float
    monitoring: float  # client overhead + tracked operations, cumulative seconds


class HistoryPoint(NamedTuple):
    """One logged step as the views' sparklines draw it (:attr:`RankState.history`)."""

    step: int
    time: float
    """The client's wall clock at the step (Unix s)."""
    loss: float | None
    """As logged, NaN and infinities included; None when the step logged no loss."""
    tokens: float
    """Cumulative tokens after the step (as ``tokens_total``)."""
    restarted: bool
    """The first step after a restart: a new process resumed the rank, or a rollback."""
    good: float = 0.0
    """The rank's productive plus uncheckpointed step seconds so far, this step included
    (:mod:`.analytics.goodput`: the numerator of the goodput ratio the views show)."""
    accounted: float = 0.0
    """The rank's accounted wall-clock seconds so far, this step included
    (``Goodput.totals()``); 0 while nothing is accounted."""


@dataclass(slots=True)
class RankState:
    """Everything known about one (run, rank).

    Times named ``*_mono`` are ``time.monotonic()`` of the exporter; ``last_step_time`` and
    ``started_at`` are the client's wall clock (Unix seconds, same host). Hangs are judged on
    ``last_step_mono`` (when the last step arrived), never on a wall clock that can step.
    """

    run: str
    rank: int
    local_rank: int
    world_size: int
    hostname: str
    pid: int
    client_version: str
    gpu_uuid: str | None
    started_at: float
    flops_per_token: float | None
    dtype: str
    buckets: tuple[float, ...]
    analytics: RankAnalytics
    namespace: str = ""
    """The client's Kubernetes namespace (``""`` off Kubernetes): part of the run's identity."""
    pod: str = ""
    """The client's Kubernetes pod (``""`` unknown); ``trainmon_rank_info`` carries it."""
    peer_pid: int | None = None  # SO_PEERCRED: the client's PID in the exporter's namespace
    owner_uid: int | None = None  # SO_PEERCRED uid of the connection that opened the run
    revoked: bool = False  # dropped for its run's owner claim (Store.attach): its link closes
    connected: bool = True
    status: str = "running"
    connected_mono: float = field(default_factory=time.monotonic)
    disconnected_mono: float | None = None
    left_mono: float | None = None
    """When the connection ended, whoever closed it (``disconnected_mono`` is None after a
    shutdown close): the rank's place in its store's eviction queues."""
    on_gone: Callable[[RankState], None] | None = field(default=None, repr=False, compare=False)
    """Told when the connection ends (its :class:`Store` indexes the rank for eviction)."""
    connections: int = 1
    crashes: int = 0
    rollbacks: int = 0  # steps that went backward in the same client process
    step: int | None = None
    last_step_time: float | None = None
    last_step_mono: float | None = None
    steps_total: int = 0
    tokens_total: float = 0.0
    samples_total: float = 0.0
    overhead_total: float = 0.0
    dropped_disconnected: int = 0
    dropped_backpressure: int = 0
    refused_values: int = 0
    # Delivery accounting (TOTALS records): the client's cumulative figures, and the records
    # it reported sent on a connection to this exporter that this exporter never applied.
    sent_total: int = 0
    dropped_encode_error: int = 0
    dropped_in_flight: int = 0
    unapplied_total: int = 0
    values: dict[str, float] = field(default_factory=dict)
    custom: dict[str, float | None] = field(default_factory=dict)
    nonfinite: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NONFINITE_FIELDS, 0))
    hist_counts: list[int] = field(default_factory=list)
    hist_sum: float = 0.0
    hist_count: int = 0
    window: deque[WindowPoint] = field(default_factory=lambda: deque(maxlen=2048))
    history: deque[HistoryPoint] = field(default_factory=lambda: deque(maxlen=HISTORY_STEPS))
    ops: dict[str, Operation] = field(default_factory=dict)
    checkpoint: P.Checkpoint | None = None  # the last one reported
    checkpoints_total: int = 0
    eval_values: dict[str, float | None] = field(default_factory=dict)
    layers: dict[str, dict[int, float]] = field(default_factory=dict)  # layer -> stat code -> v
    eval_step: int | None = None
    goodput: Goodput = field(default_factory=lambda: Goodput(time.monotonic()))
    """Where the rank's time went (:mod:`trainmon_exporter.analytics.goodput`)."""

    def __post_init__(self) -> None:
        self.hist_counts = [0] * (len(self.buckets) + 1)

    @property
    def run_key(self) -> str:
        """The run as the store keys it (:func:`run_key`)."""
        return run_key(self.namespace, self.run)

    @property
    def key(self) -> tuple[str, int]:
        """``(run_key, rank)``: the store's key of this rank."""
        return (self.run_key, self.rank)

    def observe_step(
        self,
        record: P.Step,
        names: Mapping[int, str],
        window_s: float,
        max_custom: int = 256,
        drop: Drop = ignore_drops,
    ) -> None:
        """Apply one STEP record.

        ``names`` maps the connection's custom field ids to names; at most ``max_custom``
        custom names are kept. Drops: ``unknown_field`` (a custom id without a NAME),
        ``custom_cap`` (a new name over ``max_custom``), ``bad_counter`` (see
        :meth:`_checked_totals`).
        """
        header, ids, values = record
        (step, steps, when, step_time, tokens, samples, overhead, d_disc, d_bp, refused) = header
        prev = self.step
        restarted = steps < self.steps_total  # a new client process resumed this rank
        rolled_back = not restarted and prev is not None and step < prev  # a checkpoint reload
        tokens, samples, overhead, bad = self._checked_totals(restarted, tokens, samples, overhead)
        if bad:
            drop("bad_counter", bad)
        if rolled_back:
            self.rollbacks += 1
        if restarted or rolled_back:
            self.analytics.reseed(rollback=rolled_back)
        if restarted or (self.window and when < self.window[-1].time):
            # The client's totals started over, or its wall clock stepped back: the rate window
            # starts again from this step instead of spanning the step.
            self.window.clear()
        stride = step - prev if prev is not None and step > prev and not rolled_back else 1
        new_tokens = tokens if restarted else tokens - self.tokens_total
        self.step = step
        self.last_step_time = when
        self.last_step_mono = mono = time.monotonic()
        self.steps_total = steps
        self.tokens_total = tokens
        self.samples_total = samples
        self.overhead_total = overhead
        self.dropped_disconnected = d_disc
        self.dropped_backpressure = d_bp
        self.refused_values = refused
        if step_time > 0.0 and step_time < math.inf:
            per_step = step_time / stride  # a rank logging every n-th step: n steps' time
            self.hist_counts[bisect_left(self.buckets, per_step)] += 1
            self.hist_sum += per_step
            self.hist_count += 1
        win = self.window
        win.append(WindowPoint(when, tokens, samples, overhead, overhead + self.ops_seconds()))
        horizon = when - window_s
        while len(win) > 2 and win[1].time <= horizon:
            win.popleft()
        unknown = capped = 0
        loss = grad_norm = mem = data_time = None
        std = P.STANDARD_NAMES
        f_loss, f_grad_norm, f_mem = P.FIELD_LOSS, P.FIELD_GRAD_NORM, P.FIELD_MEM_ALLOCATED
        for fid, v in zip(ids, values, strict=True):
            name = std.get(fid)
            if name is not None:
                self.values[name] = v
                if fid == f_loss:
                    loss = v
                elif fid == f_grad_norm:
                    grad_norm = v
                elif fid == f_mem:
                    mem = v
                elif fid == _FIELD_DATA_TIME:
                    data_time = v
                if (name == "loss" or name == "grad_norm" or name == "lr") and not math.isfinite(v):
                    self.nonfinite[name] += 1
                    self.analytics.observe_nonfinite(step, name, v)
                continue
            cname = names.get(fid)
            if cname is None:
                unknown += 1
                continue
            if cname not in self.custom and len(self.custom) >= max_custom:
                capped += 1
                continue
            self.custom[cname] = v
            if not math.isfinite(v):
                self.nonfinite["custom"] += 1
                self.analytics.observe_nonfinite(step, "custom", v)
        self.analytics.observe_step(step, loss, grad_norm, step_time, new_tokens, mem, stride)
        g = self.goodput
        g.step(
            step,
            when - wall_offset(mono),
            mono,
            data_time,
            restarted=restarted,
            rolled_back=rolled_back,
            unseen_before=steps > 1 and self.goodput.phase == "startup",
        )
        good, accounted = g.totals()
        self.history.append(
            HistoryPoint(step, when, loss, tokens, restarted or rolled_back, good, accounted)
        )
        self.analytics.totals.observe_step(self, ids)
        if unknown:
            drop("unknown_field", unknown)
        if capped:
            drop("custom_cap", capped)

    def _checked_totals(
        self, restarted: bool, tokens: float, samples: float, overhead: float
    ) -> tuple[float, float, float, int]:
        """The cumulative totals of a STEP that may be applied, and how many were refused.

        Each one that is NaN, infinite, negative, or below its previous value without a client
        restart keeps its previous value (one poisoned step cannot poison a counter) and is
        counted as refused (``bad_counter``).
        """
        inf = math.inf
        if (
            not restarted
            and self.tokens_total <= tokens < inf
            and self.samples_total <= samples < inf
            and self.overhead_total <= overhead < inf
        ):
            return tokens, samples, overhead, 0  # the usual step: every total went up or stayed
        out = []
        bad = 0
        for new, old in (
            (tokens, self.tokens_total),
            (samples, self.samples_total),
            (overhead, self.overhead_total),
        ):
            floor = 0.0 if restarted else old
            if floor <= new < math.inf:
                out.append(new)
            else:
                bad += 1
                out.append(0.0 if restarted else old)
        return out[0], out[1], out[2], bad

    def observe_totals(self, totals: P.Totals, applied: int = 0, gap: int = 0) -> int:
        """Apply a TOTALS record: the client's accounting, and the gap of its connection.

        ``applied``: data records this exporter applied from the connection so far; ``gap``:
        what :meth:`observe_totals` returned for it last time (0 at first). The gap is what
        the client says it sent on the connection less ``applied`` (records refused, dropped,
        or that never arrived); its growth is added to :attr:`unapplied_total`.

        Returns:
            The connection's gap now.
        """
        self.sent_total = totals.sent_total
        self.dropped_disconnected = totals.dropped_disconnected
        self.dropped_backpressure = totals.dropped_backpressure
        self.dropped_encode_error = totals.dropped_encode_error
        self.dropped_in_flight = totals.dropped_in_flight
        self.refused_values = totals.refused_values
        self.analytics.totals.observe_totals(self)
        now = totals.sent_connection - applied
        if now > gap:
            self.unapplied_total += now - gap
            return now
        return gap

    def observe_layers(
        self,
        names: list[str | None],
        codes: tuple[int, ...],
        values: tuple[float, ...],
        cap: int,
        export: bool = True,
        drop: Drop = ignore_drops,
    ) -> None:
        """Apply one LAYERS record's rows: ``names[r]`` is row ``r``'s layer (None: unknown id).

        With ``export`` false (a rank outside ``layer_ranks``) the layers feed the rank's
        analytics but are not kept for the per-layer series. Drops: ``unknown_field`` (no
        name), ``layer_cap`` (a new layer over ``cap``), ``layer_rank`` (analysed, not kept),
        ``unknown_stat`` (each value under a stat code outside :data:`LAYER_STAT_CODES`, in a
        row that is otherwise applied).
        """
        k = len(codes)
        unknown = capped = stats = 0
        keep: list[int] | None = None  # positions of the known stat codes, when some are not
        if not LAYER_STAT_CODES.issuperset(codes):
            keep = [i for i, c in enumerate(codes) if c in LAYER_STAT_CODES]
            codes = tuple(codes[i] for i in keep)
        rows: list[tuple[str, dict[int, float]]] = []
        for r, name in enumerate(names):
            if name is None:
                unknown += 1
                continue
            if export and name not in self.layers and len(self.layers) >= cap:
                capped += 1
                continue
            vals = values[r * k : (r + 1) * k]
            if keep is not None:
                vals = tuple(vals[i] for i in keep)
            row = dict(zip(codes, vals, strict=True))
            if export:
                self.layers[name] = row
            elif len(rows) >= cap:
                capped += 1
                continue
            if keep is not None:
                stats += k - len(keep)  # of a row applied (a refused row counts once, above)
            rows.append((name, row))
        self.analytics.observe_layers(rows)
        if unknown:
            drop("unknown_field", unknown)
        if capped:
            drop("layer_cap", capped)
        if not export and rows:
            drop("layer_rank", len(rows))
        if stats:
            drop("unknown_stat", stats)

    def observe_checkpoint(self, record: P.Checkpoint) -> None:
        """Apply a CHECKPOINT record: a save (counted), or a restore (``restore`` set)."""
        restore = record.restore
        if not restore:
            self.checkpoint = record
            self.checkpoints_total += 1
        mono, offset = clock()
        self.goodput.checkpoint(record.step, record.time - offset, record.seconds, mono, restore)

    def ops_seconds(self) -> float:
        """Cumulative seconds of every tracked operation."""
        return sum(op.seconds_total for op in self.ops.values()) if self.ops else 0.0

    def busy(self) -> bool:
        """Whether a tracked operation (``Run.track``) is running now."""
        return any(op.active for op in self.ops.values()) if self.ops else False

    def finish(self, status: int) -> None:
        """Apply a FINISH record."""
        self.status = "finished" if status == P.FINISH_OK else "failed"
        self.goodput.finish(time.monotonic(), self.status == "finished")
        if self.status == "failed":
            self.crashes += 1
            self.analytics.event("failed")

    def disconnect(self, finished: bool) -> None:
        """The trainer closed the connection; without a FINISH first, the rank crashed."""
        self.connected = False
        self.disconnected_mono = self.left_mono = time.monotonic()
        if not finished:
            self.goodput.crash(self.disconnected_mono)
            self.status = "crashed"
            self.crashes += 1
            self.analytics.event("crash")
        if self.on_gone is not None:
            self.on_gone(self)

    def closed_by_exporter(self, *, idle: bool) -> None:
        """The exporter closed the connection, which is never a crash.

        ``idle``: the trainer was silent for the idle timeout (the rank is disconnected from
        now, and expires after the TTL); otherwise the exporter is shutting down.
        """
        self.connected = False
        self.left_mono = time.monotonic()
        self.goodput.closed(self.left_mono)
        if idle:
            self.disconnected_mono = self.left_mono
        if self.on_gone is not None:
            self.on_gone(self)


class Store:
    """All rank states, with the lock that serialises ingest against scrapes.

    Admission (:meth:`attach`) is O(1) in the number of ranks: the ranks of each run, the
    ranks and series each uid holds, and the disconnected ranks in eviction order (one queue
    per status, globally and per uid, oldest first) are kept indexed as ranks come and go.

    Tenancy: a uid holds at most ``max_ranks_per_uid`` ranks and ``max_series_per_uid``
    series of the ``max_ranks`` and ``max_series`` of the node, so one uid cannot take the
    slots or the series budget of the others. A disconnected rank stays for at least
    ``retention_s`` whoever connects (its crash alert can fire); after that it may be evicted
    to make room, first by its own uid. A run's owner is remembered past the eviction of its
    last rank in a table bounded per uid (``4 × max_ranks_per_uid`` runs), so another uid's
    churn cannot push it out.

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
    ) -> None:
        self.lock = threading.Lock()
        self.default_namespace = default_namespace
        self.ranks: dict[tuple[str, int], RankState] = {}
        self.max_ranks = max_ranks
        self.max_series = max_series
        self.max_ranks_per_uid = min(max_ranks, max_ranks_per_uid or max_ranks)
        self.max_series_per_uid = min(max_series, max_series_per_uid or max_series)
        self.retention_s = min(retention_s, ttl_s)
        self.max_operations = max_operations
        self.series_used = 0  # estimate of the rank series exported (see series_of)
        self.evicted: dict[str, int] = dict.fromkeys(EVICTION_ORDER, 0)
        # Indexes kept in step with self.ranks (see _add and _remove).
        self._runs: dict[str, dict[int, RankState]] = {}
        self.uid_ranks: dict[int | None, int] = {}
        self.uid_series: dict[int | None, int] = {}
        self._gone: dict[str, OrderedDict[tuple[str, int], RankState]] = {
            b: OrderedDict() for b in EVICTION_ORDER
        }
        self._gone_uid: dict[int | None, dict[str, OrderedDict[tuple[str, int], RankState]]] = {}
        # run -> (owner uid, monotonic time the record lapses): runs whose every rank was
        # evicted keep their owner until the series TTL, so their id cannot be taken over.
        # Bounded per uid (_owner_runs), oldest first, never by another uid's records.
        self.owners: OrderedDict[str, tuple[int | None, float]] = OrderedDict()
        self._owner_runs: dict[int | None, OrderedDict[str, None]] = {}
        self.max_owner_records = 4 * self.max_ranks_per_uid
        self.hellos_refused: dict[tuple[str, str], int] = {}
        self.hellos_refused_at: dict[tuple[str, str], float] = {}  # same keys: latest, Unix s
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
        credentials for. Call under :attr:`lock`.
        """
        label = "unknown" if uid is None else str(uid)
        key = (reason, label)
        if uid is not None and key not in self.hellos_refused:
            known = self._refused_uids()
            if label not in known and len(known) >= MAX_REFUSED_UIDS:
                key = (reason, "other")
        self.hellos_refused[key] = self.hellos_refused.get(key, 0) + 1
        self.hellos_refused_at[key] = time.time()

    def _refused_uids(self) -> set[str]:
        return {u for _, u in self.hellos_refused if u not in ("other", "unknown")}

    # ------------------------------------------------------------------ the indexes

    def _add(self, state: RankState) -> None:
        """Index a new rank (its series are already taken)."""
        self.ranks[state.key] = state
        self._runs.setdefault(state.run_key, {})[state.rank] = state
        self.uid_ranks[state.owner_uid] = self.uid_ranks.get(state.owner_uid, 0) + 1
        state.on_gone = self._gone_now

    def _gone_now(self, state: RankState) -> None:
        """``state``'s connection ended: queue it for eviction (oldest first per status)."""
        bucket = state.status if state.status in self._gone else "running"
        self._gone[bucket][state.key] = state
        queues = self._gone_uid.get(state.owner_uid)
        if queues is None:
            queues = self._gone_uid[state.owner_uid] = {b: OrderedDict() for b in EVICTION_ORDER}
        queues[bucket][state.key] = state

    def _unqueue(self, state: RankState) -> None:
        """Take ``state`` out of the eviction queues (it resumed or is removed)."""
        key = state.key
        for q in self._gone.values():
            if q.pop(key, None) is not None:
                break
        queues = self._gone_uid.get(state.owner_uid)
        if queues is not None:
            for q in queues.values():
                if q.pop(key, None) is not None:
                    break
            if not any(queues.values()):
                del self._gone_uid[state.owner_uid]

    def _victim(self, uid: int | None, anyone: bool, now: float) -> RankState | None:
        """The disconnected rank to evict first: of ``uid`` (or of anyone), past retention.

        First in :data:`EVICTION_ORDER`, oldest first within a status; a rank that left less
        than ``retention_s`` ago is never chosen. O(1): the head of at most four queues.
        """
        queues = self._gone if anyone else self._gone_uid.get(uid)
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

    def _remove(self, state: RankState, *, remember: bool = True) -> None:
        """Forget a rank; if it was its run's last, remember the run's owner until the TTL."""
        key = state.key
        del self.ranks[key]
        self._unqueue(state)
        state.on_gone = None
        run_ranks = self._runs[state.run_key]
        del run_ranks[state.rank]
        left = self.uid_ranks.get(state.owner_uid, 0) - 1
        if left > 0:
            self.uid_ranks[state.owner_uid] = left
        else:
            self.uid_ranks.pop(state.owner_uid, None)
        self._free_series(self.series_of(state), state.owner_uid)
        if run_ranks:
            return
        del self._runs[state.run_key]
        now = time.monotonic()
        lapse = (state.disconnected_mono or now) + self.ttl_s
        if remember and lapse > now:
            self._remember_owner(state.run_key, state.owner_uid, lapse)

    def _remember_owner(self, run: str, uid: int | None, lapse: float) -> None:
        self._forget_owner(run)
        self.owners[run] = (uid, lapse)
        mine = self._owner_runs.setdefault(uid, OrderedDict())
        mine[run] = None
        while len(mine) > self.max_owner_records:  # the uid's own oldest record goes
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

    def owner_of(self, run: str) -> int | None:
        """The uid that owns ``run`` (a key) now: its owner claim, ranks or owner record."""
        claimed = self._claimed(run)
        if claimed is not None:
            return claimed
        holder = self.run_state(run)
        if holder is not None:
            return holder.owner_uid
        entry = self.owners.get(run)
        return None if entry is None else entry[0]

    def attach(
        self, hello: dict[str, Any], uid: int | None = None, pid: int | None = None
    ) -> RankState | str:
        """Bind a new connection to its (run, rank) state, creating or resuming it.

        ``uid`` and ``pid`` are the connecting process's (``SO_PEERCRED``; ``pid`` in the
        exporter's PID namespace, kept as :attr:`RankState.peer_pid`). A run belongs to the uid
        that opened it for as long as any of its ranks has state here (until the last one
        expires): another uid, root included, can neither add a rank nor resume one, nor
        pre-empt a live one.

        Returns the state, or a refusal reason: ``not_owner`` (the run belongs to another
        uid), ``duplicate_rank`` (that rank is already connected), ``uid_rank_quota`` (the
        uid holds ``max_ranks_per_uid`` ranks and none of its own is past retention),
        ``too_many_ranks`` (``max_ranks`` reached, none past retention), ``uid_series_quota``
        (the uid's share of the series budget is spent) or ``series_budget`` (``max_series``
        spent). A rank that reconnects after a crash or a lost connection keeps
        its exporter-side counters (the run resumed under the same id); one that had finished
        cleanly starts from fresh state (the id was reused for a new run).
        """
        hello = {"namespace": "", "pod": "", **hello}  # a client off Kubernetes sends neither
        hello["namespace"] = hello["namespace"] or self.default_namespace
        run = run_key(hello["namespace"], hello["run"])
        key = (run, hello["rank"])
        state = self.ranks.get(key)
        holder = state if state is not None else self.run_state(run)
        claimed = self._claimed(run)
        if claimed is not None:
            if claimed != uid:
                return "not_owner"
            if holder is not None and holder.owner_uid != uid:
                self._revoke(run)  # opened by another uid before the claim: a squatter
                state = holder = None
        if holder is not None and holder.owner_uid != uid:
            return "not_owner"
        now = time.monotonic()
        if holder is None and run in self.owners:
            owner, lapse = self.owners[run]
            if lapse > now and owner != uid and claimed is None:
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
            self._unqueue(state)
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
        refusal = self._make_room(uid, now)
        if refusal is not None:
            return refusal
        state = RankState(
            **{k: hello[k] for k in P.HELLO_FIELDS},
            buckets=self.buckets,
            analytics=RankAnalytics(self.analytics),
            goodput=Goodput.start(hello["started_at"], now, time.time() - now),
        )
        state.owner_uid = uid
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
        """Forget every rank of ``run``, whose owner is not the uid its claim names.

        Each is marked :attr:`RankState.revoked`, so a connection still bound to it is closed
        (refused ``not_owner``, counted by its uid) at its next packet.
        """
        for state in list(self._runs.get(run, {}).values()):
            self._remove(state, remember=False)
            state.revoked = True
            self.count_refused_hello("not_owner", state.owner_uid)

    def _make_room(self, uid: int | None, now: float) -> str | None:
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
            elif self.take_series(1, state.owner_uid):
                values[name] = v
            else:
                drop("series_budget", 1)
        state.eval_step = record.step
        mono, offset = clock()
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
        state.goodput.operation(name, seconds_total, time.monotonic())
        op = state.ops.get(name)
        if op is not None:
            op.seconds_total, op.runs_total, op.active = seconds_total, runs_total, active
            return
        if len(state.ops) >= self.max_operations:
            drop("operation_cap", 1)
        elif not self.take_series(SERIES_PER_OPERATION, state.owner_uid):
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
        while added and not self.take_series(added * cost, state.owner_uid):
            table.popitem()  # dicts keep insertion order: the newest name goes
            added -= 1
            refused += 1
        if refused:
            drop("series_budget", refused)

    def expire(self, now_mono: float | None = None) -> int:
        """Drop ranks disconnected for longer than the TTL. Returns how many were dropped.

        A rank the exporter closed (idle, or at shutdown) counts from when it closed it.
        O(ranks dropped): the eviction queues hold disconnected ranks oldest first.
        """
        now_mono = time.monotonic() if now_mono is None else now_mono
        n = 0
        with self.lock:
            for q in self._gone.values():
                while q:
                    s = next(iter(q.values()))
                    left = s.left_mono if s.left_mono is not None else now_mono
                    if now_mono - left < self.ttl_s:
                        break  # the oldest of this status is not due yet
                    self._remove(s, remember=False)
                    n += 1
            self.expired_total += n
            while self.owners:
                run, (_uid, lapse) = next(iter(self.owners.items()))
                if lapse > now_mono:
                    break
                self._forget_owner(run)
            self.recount_series()
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
