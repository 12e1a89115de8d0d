"""One (run, rank): :class:`RankState`, its figures, and how each record changes them.

Why this module is one module of about 500 lines: :class:`RankState` is the one place a rank's
figures change (a step, layers, an evaluation, a checkpoint, totals; finish, disconnect), and
each ``observe_*`` method keeps its record's fields together with the counters, the history
and the time accounting they move. The limits a record is applied under (custom metrics,
layers, operations, the series budget) are :class:`~trainmon_exporter.state.store.Store`'s;
judgement is elsewhere (:mod:`trainmon_exporter.analytics`, :mod:`trainmon_exporter.derive`).

Values a record carries that cannot be kept are reported to a :data:`Drop` callable with
their reason (a ``reason`` of ``trainmon_ingest_values_dropped_total``), never raised.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

from trainmon_client import _protocol as P
from trainmon_exporter.analytics import RankAnalytics
from trainmon_exporter.analytics.goodput import Goodput
from trainmon_exporter.state.evidence import Evidence

NONFINITE_FIELDS = ("loss", "grad_norm", "lr", "custom")
"""``field`` label values of ``trainmon_train_nonfinite_values_total``; ``custom`` sums every
custom metric, so each series exists at 0 from a rank's first message."""
STATUSES = ("running", "finished", "failed", "crashed")


def run_key(namespace: str, run: str) -> str:
    """The run as the store keys it: ``namespace/run`` in a Kubernetes namespace, else the id.

    A run id has no ``/``, so the two forms never meet, and one namespace's run never shares
    state, owner or ranks with another namespace's run of the same id.
    """
    return f"{namespace}/{run}" if namespace else run


Tenant: TypeAlias = str | int | None
"""Who holds ranks, series and connections on a node, and owns runs: the namespace of the
trainer's pod as the node tells it (a ``str``; :mod:`trainmon_exporter.peers`), else its uid
(an ``int``, ``SO_PEERCRED``; None where the kernel gave none). A namespace and a uid never
compare equal, so a pod's namespace and a process that merely names it are two tenants."""


def tenant_of(namespace: str, uid: int | None) -> Tenant:
    """The tenant of a process: its verified ``namespace`` where it has one, else ``uid``."""
    return namespace or uid


def tenant_labels(tenant: Tenant) -> tuple[str, str]:
    """``(namespace, uid)`` label values of ``tenant``: one of them is empty.

    ``uid`` is ``unknown`` for a peer the kernel gave no credentials for.
    """
    if isinstance(tenant, str):
        return tenant, ""
    return "", "unknown" if tenant is None else str(tenant)


def describe_tenant(tenant: Tenant) -> str:
    """``tenant`` for a log line: ``namespace team-a``, ``uid 1000`` or ``an unknown uid``."""
    if isinstance(tenant, str):
        return f"namespace {tenant}"
    return "an unknown uid" if tenant is None else f"uid {tenant}"


HISTORY_STEPS = 240
"""Logged steps each rank keeps for the views' sparklines (:attr:`RankState.history`)."""
LAYER_STAT_CODES = frozenset(
    (*P.LAYER_STATS.values(), *(P.QUANTILE_CODE0 + i for i in range(len(P.LAYER_QUANTILES))))
)
"""Stat codes a LAYERS record may carry; values under any other code are dropped
(``unknown_stat``), never stored."""
_FIELD_DATA_TIME = P.FIELD_DATA_TIME
"""Field id of a step's input wait (s), for the time accounting
(:mod:`trainmon_exporter.analytics.goodput`)."""
_ACCOUNTING_FIELDS = frozenset(
    (P.FIELD_DATA_TIME_TOTAL, P.FIELD_CHECKPOINT_STEP, P.FIELD_CHECKPOINT_TIME_TOTAL)
)
"""The running totals a client sends for the time accounting (its lost records' share)."""
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
    (:mod:`trainmon_exporter.analytics.goodput`: the numerator of the goodput ratio the views
    show)."""
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
    tenant: Tenant = None
    """The tenant that opened the run (:data:`Tenant`): it owns the run and holds the rank."""
    revoked: str | None = None
    """Why the store dropped this rank while a connection may still be bound to it (a REFUSED
    reason: ``not_owner`` for its run's owner claim or namespace, ``evicted`` to make room for
    a tenant below its fair share); the connection is closed with it."""
    connected: bool = True
    status: str = "running"
    connected_mono: float = field(default_factory=time.monotonic)
    disconnected_mono: float | None = None
    left_mono: float | None = None
    """When the connection ended, whoever closed it (``disconnected_mono`` is None after a
    shutdown close): the rank's place in its store's eviction queues."""
    on_gone: Callable[[RankState], None] | None = field(default=None, repr=False, compare=False)
    """Told when the connection ends (its store's
    :class:`~trainmon_exporter.state.admission.Admission` queues the rank for eviction)."""
    connections: int = 1
    crashes: int = 0
    rollbacks: int = 0  # steps that went backward in the same client process
    step: int | None = None
    last_step_time: float | None = None
    last_step_mono: float | None = None
    phase_end_mono: float | None = None
    """When its last tracked operation ended, or its last evaluation or checkpoint arrived:
    the hang clock starts again there (a rank just out of a long checkpoint save has its
    usual step time to step again, :attr:`quiet_since_mono`)."""
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
    hang: Evidence | None = None
    """The evidence of its last hang episode (:mod:`trainmon_exporter.state.evidence`): asked
    for when the episode started, kept after it ends until the rank expires."""

    def __post_init__(self) -> None:
        self.hist_counts = [0] * (len(self.buckets) + 1)

    @property
    def run_key(self) -> str:
        """The run as the store keys it (:func:`run_key`)."""
        return run_key(self.namespace, self.run)

    @property
    def quiet_since_mono(self) -> float | None:
        """Since when the rank has given no sign of progress; None before a step.

        Its last step, or the end of its last tracked operation, evaluation or checkpoint if
        later (the hang clock, :mod:`trainmon_exporter.analytics.run`).
        """
        if self.last_step_mono is None:
            return None
        if self.phase_end_mono is None:
            return self.last_step_mono
        return max(self.last_step_mono, self.phase_end_mono)

    @property
    def key(self) -> tuple[str, int]:
        """``(run_key, rank)``: the store's key of this rank."""
        return (self.run_key, self.rank)

    @property
    def stepping(self) -> bool:
        """Whether a STEP arrived since the rank's connection (re)started."""
        return self.last_step_mono is not None and self.last_step_mono >= self.connected_mono

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
        lost = not restarted and (
            steps > self.steps_total + 1
            or d_disc > self.dropped_disconnected
            or d_bp > self.dropped_backpressure
        )  # records of this process went missing since its last STEP here
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
        totals: dict[int, float] | None = None
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
                elif fid in _ACCOUNTING_FIELDS:
                    if totals is None:
                        totals = {}
                    totals[fid] = v
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
        saved = None
        if totals is not None and P.FIELD_CHECKPOINT_STEP in totals:
            ck_step = totals[P.FIELD_CHECKPOINT_STEP]
            if 0 <= ck_step <= P.MAX_STEP:
                saved = (ck_step, totals.get(P.FIELD_CHECKPOINT_TIME_TOTAL, 0.0))
        g.step(
            step,
            when - wall_offset(mono),
            mono,
            data_time,
            restarted=restarted,
            rolled_back=rolled_back,
            unseen_before=steps > 1 and self.goodput.phase == "startup",
            data_total=None if totals is None else totals.get(P.FIELD_DATA_TIME_TOTAL),
            saved=saved,
            lost=lost,
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
        self.phase_end_mono = mono
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
