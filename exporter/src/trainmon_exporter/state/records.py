"""The rows of the exporter's state file: a rank's durable record as plain JSON data.

:func:`rank_row` writes a live rank, :func:`departed_row` a departed record of the
:class:`~trainmon_exporter.state.ledger.Ledger`, :func:`goodput_record` their time accounting
(its instants as wall-clock times, so another process reads them on its own monotonic
clock); :func:`parse_row` reads one back, checking every field, so a row of a corrupt or
forged file is refused, never trusted (the HELLO's own checks are passed in by the caller);
:func:`restored_state` makes a live rank of a row again.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trainmon_client import _protocol as P
from trainmon_exporter.analytics import RankAnalytics
from trainmon_exporter.analytics.goodput import (
    KINDS,
    MAX_PENDING_SPANS,
    PHASES,
    PRIORITY,
    Goodput,
    Span,
)
from trainmon_exporter.state.ledger import Departed, hello_of
from trainmon_exporter.state.rank import STATUSES, RankState, run_key, tenant_labels, tenant_of

__all__ = [
    "MAX_RECORD_RANGES",
    "RECORD_VERSION",
    "Row",
    "departed_row",
    "goodput_from_record",
    "goodput_record",
    "parse_row",
    "rank_row",
    "restored_state",
]

MAX_RECORD_RANGES = 32
"""Held step ranges an accounting record keeps (merged oldest first beyond it)."""
RECORD_VERSION = 1
"""Version of :func:`goodput_record`'s layout."""


def goodput_record(g: Goodput, offset: float) -> dict[str, Any]:
    """This accounting as plain JSON data, instants as wall-clock times (``+ offset``).

    Ranges beyond :data:`MAX_RECORD_RANGES` are merged oldest first; the data-loading
    window of the rate window is not kept.
    """
    ranges = [list(r) for r in g.ranges]
    while len(ranges) > MAX_RECORD_RANGES:
        a = ranges.pop(0)
        ranges[0][0] = a[0]
        ranges[0][2] += a[2]
    return {
        "v": RECORD_VERSION,
        "init": g.init + offset,
        "cursor": g.cursor + offset,
        "phase": g.phase,
        "productive": g.productive,
        "badput": dict(g.badput),
        "spans": [
            [sp.kind, None if sp.start is None else sp.start + offset, sp.end + offset]
            for sp in g.spans
        ],
        "ranges": ranges,
        "partial": g.partial,
        "first": None if g.first is None else list(g.first),
        "risk": g.risk,
        "last_step": g.last_step,
        "stride": g.stride,
        "restored_step": g.restored_step,
        "saved_step": g.saved_step,
        "fresh": g.fresh,
        "data_seen": g.data_seen,
        "ops": dict(g.op_seconds),
        "wire_data": g.wire_data,
        "saves_seen": g.saves_seen,
    }


def goodput_from_record(rec: Mapping[str, Any], offset: float, now: float) -> Goodput:
    """The accounting :func:`goodput_record` wrote, read back.

    Its instants are mapped with ``offset`` (wall minus monotonic time now), none later
    than ``now``.

    Raises:
        ValueError: a field is missing, of the wrong type, negative, not finite, or of
            another record version.
    """
    if rec.get("v") != RECORD_VERSION:
        raise ValueError(f"accounting record version {rec.get('v')!r}, expected 1")
    init = min(_field(rec, "init") - offset, now)
    g = Goodput(init=init)
    g.cursor = _clamp(_field(rec, "cursor") - offset, init, now)
    phase = rec.get("phase")
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    g.phase = phase
    g.productive = _field(rec, "productive", lo=0.0)
    badput = rec.get("badput")
    if not isinstance(badput, Mapping) or set(badput) != set(KINDS):
        raise ValueError("badput must hold every kind")
    g.badput = {k: _field(badput, k, lo=0.0) for k in KINDS}
    for sp in _bounded(rec, "spans", MAX_PENDING_SPANS):
        if not (isinstance(sp, list) and len(sp) == 3 and sp[0] in PRIORITY):
            raise ValueError("a span is [kind, start or null, end]")
        end = _clamp(_finite(sp[2], "span end") - offset, init, now)
        start = None if sp[1] is None else min(_finite(sp[1], "span start") - offset, end)
        g.spans.append(Span(sp[0], start, end))
    for r in _bounded(rec, "ranges", MAX_RECORD_RANGES):
        if not (isinstance(r, list) and len(r) == 3):
            raise ValueError("a range is [first step, last step, seconds]")
        first, last, seconds = (_finite(x, "range") for x in r)
        if not (0 <= first <= last and seconds >= 0) or (g.ranges and first <= g.ranges[-1][1]):
            raise ValueError("ranges must be ordered, non-overlapping and non-negative")
        g.ranges.append([first, last, seconds])
    g.partial = _field(rec, "partial", lo=0.0)
    first_rec = rec.get("first")
    if first_rec is not None:
        if not (isinstance(first_rec, list) and len(first_rec) == 2):
            raise ValueError("first is [step, seconds]")
        g.first = [
            _finite(first_rec[0], "first step"),
            max(0.0, _finite(first_rec[1], "first seconds")),
        ]
    g.risk = rec.get("risk") is True
    g.last_step = _opt_step(rec, "last_step")
    g.stride = max(1, _opt_step(rec, "stride") or 1)
    g.restored_step = _opt_step(rec, "restored_step")
    g.saved_step = _opt_step(rec, "saved_step")
    g.fresh = rec.get("fresh") is True
    g.data_seen = rec.get("data_seen") is True
    ops = rec.get("ops", {})
    if not isinstance(ops, Mapping) or len(ops) > 64:
        raise ValueError("ops must be a mapping of at most 64 operations")
    g.op_seconds = {str(k): _field(ops, k, lo=0.0) for k in ops}
    wire = rec.get("wire_data")
    g.wire_data = None if wire is None else _field(rec, "wire_data", lo=0.0)
    g.saves_seen = _field(rec, "saves_seen", lo=0.0) if "saves_seen" in rec else 0.0
    # The identity accounted = cursor - init holds for what was written; keep it so.
    g.cursor = max(g.cursor, min(now, g.init + g.accounted()))
    g.init = g.cursor - g.accounted()
    return g


_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""A Kubernetes namespace name (an RFC 1123 label)."""

ROW_KEYS = frozenset(
    {
        "hello",
        "owner_uid",
        "owner_namespace",
        "status",
        "crashes",
        "step",
        "steps_total",
        "tokens_total",
        "samples_total",
        "last_step_time",
        "checkpoint",
        "checkpoints_total",
        "departed_ago",
        "goodput",
    }
)
"""Keys of a row; a row with others (or without one of these) is refused."""


@dataclass(slots=True)
class Row:
    """One row of the state file, checked.

    A live rank's (``departed_ago`` None) or a departed record's (how many seconds before the
    save it departed).
    """

    hello: dict[str, Any]
    owner_uid: int | None
    owner_namespace: str
    """The verified namespace of its tenant (``""``: the tenant is ``owner_uid``)."""
    status: str
    crashes: int
    step: int | None
    steps_total: int
    tokens_total: float
    samples_total: float
    last_step_time: float | None
    checkpoint: P.Checkpoint | None
    checkpoints_total: int
    departed_ago: float | None
    goodput: Goodput

    @property
    def key(self) -> tuple[str, int]:
        """``(run_key, rank)``, as the store keys ranks."""
        return (run_key(self.hello["namespace"], self.hello["run"]), self.hello["rank"])


def rank_row(state: RankState, offset: float) -> dict[str, Any]:
    """The row of a live rank (``offset``: wall minus monotonic time now)."""
    cp = state.checkpoint
    return {
        "hello": hello_of(state),
        "owner_uid": state.owner_uid,
        "owner_namespace": tenant_labels(state.tenant)[0],
        "status": state.status,
        "crashes": state.crashes,
        "step": state.step,
        "steps_total": state.steps_total,
        "tokens_total": state.tokens_total,
        "samples_total": state.samples_total,
        "last_step_time": state.last_step_time,
        "checkpoint": None if cp is None else [cp.step, cp.time, _json_num(cp.seconds)],
        "checkpoints_total": state.checkpoints_total,
        "departed_ago": None,
        "goodput": goodput_record(state.goodput, offset),
    }


def departed_row(d: Departed, offset: float, now: float) -> dict[str, Any]:
    """The row of a departed record (``now``: monotonic time of the save)."""
    return {
        "hello": dict(d.hello),
        "owner_uid": d.owner_uid,
        "owner_namespace": tenant_labels(d.tenant)[0],
        "status": d.status,
        "crashes": 0,
        "step": d.step,
        "steps_total": d.steps_total,
        "tokens_total": 0.0,
        "samples_total": 0.0,
        "last_step_time": None,
        "checkpoint": None,
        "checkpoints_total": 0,
        "departed_ago": max(0.0, now - d.since),
        "goodput": goodput_record(d.goodput, offset),
    }


def parse_row(
    row: object,
    offset: float,
    now: float,
    check_hello: Callable[[Mapping[str, Any]], dict[str, Any]],
) -> Row:
    """A row written by :func:`rank_row` or :func:`departed_row`, checked.

    ``offset`` and ``now``: see :func:`goodput_from_record`. ``check_hello`` applies the
    checks a HELLO passes on the wire and returns its fields, raising ``ValueError`` for a
    HELLO the exporter would refuse.

    Raises:
        ValueError: anything out of place, said in one line.
    """
    if not isinstance(row, Mapping) or set(row) != ROW_KEYS:
        raise ValueError("a row must hold exactly: " + ", ".join(sorted(ROW_KEYS)))
    hello_in = row["hello"]
    if not isinstance(hello_in, Mapping) or set(hello_in) != set(P.HELLO_FIELDS):
        raise ValueError("hello must hold every HELLO field")
    hello = check_hello(hello_in)
    owner = row["owner_uid"]
    if owner is not None and not (_is_int(owner) and 0 <= owner < 2**32 - 1):
        raise ValueError(f"owner_uid {owner!r} is not a uid")
    owner_ns = row["owner_namespace"]
    if not isinstance(owner_ns, str) or (owner_ns and not _NAMESPACE.fullmatch(owner_ns)):
        raise ValueError(f"owner_namespace {owner_ns!r} is not a Kubernetes namespace")
    status = row["status"]
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r}")
    cp = row["checkpoint"]
    checkpoint = None
    if cp is not None:
        if not (isinstance(cp, list) and len(cp) == 3 and _is_step(cp[0])):
            raise ValueError("checkpoint is [step, time, seconds or null]")
        seconds = math.nan if cp[2] is None else _finite(cp[2], "checkpoint seconds")
        checkpoint = P.Checkpoint(cp[0], _finite(cp[1], "checkpoint time"), seconds)
    ago = row["departed_ago"]
    goodput = row["goodput"]
    if not isinstance(goodput, Mapping):
        raise ValueError("goodput must be an accounting record")
    return Row(
        hello=hello,
        owner_uid=owner,
        owner_namespace=owner_ns,
        status=status,
        crashes=_count(row["crashes"], "crashes"),
        step=None if row["step"] is None else _step(row["step"]),
        steps_total=_count(row["steps_total"], "steps_total"),
        tokens_total=_nonneg(row["tokens_total"], "tokens_total"),
        samples_total=_nonneg(row["samples_total"], "samples_total"),
        last_step_time=(
            None if row["last_step_time"] is None else _finite(row["last_step_time"], "time")
        ),
        checkpoint=checkpoint,
        checkpoints_total=_count(row["checkpoints_total"], "checkpoints_total"),
        departed_ago=None if ago is None else _nonneg(ago, "departed_ago"),
        goodput=goodput_from_record(goodput, offset, now),
    )


def restored_state(
    row: Row, buckets: tuple[float, ...], analytics: RankAnalytics, now: float
) -> RankState:
    """The live rank of ``row``, as the exporter that wrote it left it: disconnected.

    Its connection ended with that exporter: it counts as closed by the exporter (its
    accounting detached, see :meth:`Goodput.closed`), from ``now`` (monotonic).
    """
    state = RankState(
        **{k: row.hello[k] for k in P.HELLO_FIELDS},
        buckets=buckets,
        analytics=analytics,
        goodput=row.goodput,
    )
    state.owner_uid = row.owner_uid
    state.tenant = tenant_of(row.owner_namespace, row.owner_uid)
    state.status = row.status
    state.crashes = row.crashes
    state.step = row.step
    state.steps_total = row.steps_total
    state.tokens_total = row.tokens_total
    state.samples_total = row.samples_total
    state.last_step_time = row.last_step_time
    state.checkpoint = row.checkpoint
    state.checkpoints_total = row.checkpoints_total
    state.connected = False
    state.left_mono = now
    state.disconnected_mono = None if row.status == "running" else now
    state.goodput.closed(now)
    return state


def _json_num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_step(x: object) -> bool:
    return _is_int(x) and 0 <= x <= P.MAX_STEP  # type: ignore[operator]


def _step(x: object) -> int:
    if not _is_step(x):
        raise ValueError(f"{x!r} is not a step")
    return x  # type: ignore[return-value]


def _count(x: object, what: str) -> int:
    if not (_is_int(x) and 0 <= x < 2**64):  # type: ignore[operator]
        raise ValueError(f"{what} must be a count, got {x!r}")
    return x  # type: ignore[return-value]


def _finite(x: object, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise ValueError(f"{what} must be a finite number, got {x!r}")
    return float(x)


def _nonneg(x: object, what: str) -> float:
    v = _finite(x, what)
    if v < 0:
        raise ValueError(f"{what} must not be negative, got {v}")
    return v


def _clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def _field(rec: Mapping[str, Any], key: str, lo: float = -math.inf) -> float:
    x = _finite(rec.get(key), key)
    if x < lo:
        raise ValueError(f"{key} must be at least {lo}, got {x}")
    return x


def _opt_step(rec: Mapping[str, Any], key: str) -> int | None:
    x = rec.get(key)
    return None if x is None else _step(x)


def _bounded(rec: Mapping[str, Any], key: str, most: int) -> list[Any]:
    x = rec.get(key)
    if not isinstance(x, list) or len(x) > most:
        raise ValueError(f"{key} must be a list of at most {most}")
    return x
