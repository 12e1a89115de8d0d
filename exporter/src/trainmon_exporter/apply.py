"""Applying a trainer's records: each packet's records become changes to its rank's state.

The socket server (:mod:`trainmon_exporter.ingest`) reads packets and hands each one, with the
:class:`Link` of its connection, to :meth:`Applier.packet`. Here the packet is split into
records, each record is decoded to its typed form (:func:`trainmon_client._protocol.decode_record`)
and checked against what its connection may send (a HELLO first and only once, a NAME within
its cap), then dispatched once, by type, to the :class:`~trainmon_exporter.state.store.Store` or
:class:`~trainmon_exporter.state.rank.RankState` method that applies it. Nothing here changes a
rank's state itself. A HELLO is held to what the kernel and the node say of its sender (its
uid, and its pod's namespace where the node names one: :class:`Link`) before the store binds
it to a rank.

Why this module is one module of about 540 lines: a HELLO's checks (its fields, its labels,
its sender's verified pod) and the dispatch of every later record share one connection's
:class:`Link` and one refusal accounting, which are only right together.

Why this module is one module of about 530 lines: it is the one place where a record's meaning
is checked against what its connection may send (the HELLO's schema and ownership, the names a
connection binds, the refusals and drops each counted), then dispatched once; the packet being
applied in slices and the counters that stamp the time of an invalid record are that checking's
own bookkeeping.

Bad input never raises out of here: a refused packet or record increments
``trainmon_ingest_messages_invalid_total{reason}``, and a value a record carries that cannot
be kept ``trainmon_ingest_values_dropped_total{reason}``. A packet's records are refused for
the protocol's reasons (:data:`trainmon_client._protocol.PROTOCOL_ERRORS`), for
:data:`REFUSALS`, or as :data:`INTERNAL_ERROR`; :class:`~trainmon_client._protocol.ProtocolError`
and :class:`Refused` check their reason is one of theirs, so every reason counted has its
counter.
"""

from __future__ import annotations

import enum
import logging
import math
import string
import time
import unicodedata
from collections.abc import Iterator
from typing import Final

from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainmon_client import _names as N
from trainmon_client import _protocol as P
from trainmon_exporter.state.rank import RankState, Tenant, describe_tenant, tenant_of
from trainmon_exporter.state.store import Store

__all__ = [
    "FATAL",
    "INTERNAL_ERROR",
    "LABEL_CHARS",
    "MAX_NAMES_PER_CONNECTION",
    "REFUSALS",
    "Applier",
    "HelloMessage",
    "Link",
    "Outcome",
    "Packet",
    "Refused",
    "StampedCounter",
]

log = logging.getLogger("trainmon_exporter.ingest")

REFUSALS: Final = (
    "no_hello",
    "duplicate_hello",
    "bad_hello",
    "invalid_name",
    "duplicate_rank",
    "too_many_ranks",
    "name_cap",
    "not_owner",
    "peer_not_allowed",
    "series_budget",
    "uid_rank_quota",
    "uid_series_quota",
    "namespace_mismatch",
)
"""Every reason a well-formed record is refused for (a :class:`Refused` with another reason
is a bug); :meth:`Store.attach`'s refusals are among them."""
INTERNAL_ERROR: Final = "internal_error"
"""Reason of a record whose application raised an exception nobody foresaw."""
FATAL: Final = frozenset(
    {
        "bad_hello",
        "duplicate_rank",
        "too_many_ranks",
        "not_owner",
        "peer_not_allowed",
        "series_budget",
        "uid_rank_quota",
        "uid_series_quota",
        "namespace_mismatch",
    }
)
"""Refusals of a HELLO: the connection has no identity, so it is closed. Each is also counted
by the peer's namespace and uid (:meth:`Admission.count_refused_hello`,
``trainmon_ingest_hellos_refused_total``), with a HELLO the protocol refuses (``malformed``...)
under its protocol reason."""
MAX_NAMES_PER_CONNECTION: Final = 4096
"""Names one connection may bind (custom metrics, operations, layers): a memory bound. The
client binds at most 1,024 custom names plus its layers and operations."""


class Refused(Exception):
    """A well-formed record this connection may not send now.

    Attributes:
        reason: one of :data:`REFUSALS` (anything else raises ``ValueError``).
    """

    def __init__(self, reason: str) -> None:
        if reason not in REFUSALS:
            raise ValueError(f"not a refusal reason: {reason!r}")
        super().__init__(reason)
        self.reason = reason


class Outcome(enum.Enum):
    """What became of one record."""

    APPLIED = enum.auto()
    """Applied (counted in ``trainmon_ingest_messages_total{type}``)."""
    SKIPPED = enum.auto()
    """Not applied, counted as invalid or dropped; the rest of the packet applies."""
    CLOSE = enum.auto()
    """Refused, and the connection must close (a HELLO that cannot be accepted)."""


LABEL_CHARS: Final = frozenset(string.ascii_letters + string.digits + "._-:/+")
"""Characters a HELLO value that becomes a label value keeps (hostname, GPU UUID, client
version, dtype): ASCII letters and digits, and ``. _ - : / +`` (host names of RFC 1123, NVML
UUIDs and MIG paths, PEP 440 versions). No label of trainmon takes free text."""
LABEL_FIELDS: Final = ("hostname", "gpu_uuid", "client_version", "dtype")
"""HELLO fields exported as labels of ``trainmon_rank_info``."""


def label_value(value: str, limit: int) -> str:
    """``value`` with only :data:`LABEL_CHARS`, at most ``limit`` characters.

    Compatibility forms are decomposed (NFKD: a full-width ``Ｈ`` is ``H``, ``é`` is ``e`` and an
    accent) and combining marks dropped (accents, "zalgo" stacks); any other character
    (letters of other scripts, homoglyphs, emoji, spaces) becomes ``_``, a run of them one ``_``.
    """
    if LABEL_CHARS.issuperset(value):
        return value
    out: list[str] = []
    for ch in unicodedata.normalize("NFKD", value):
        if ch in LABEL_CHARS:
            out.append(ch)
        elif unicodedata.category(ch).startswith("M"):
            continue
        elif not out or out[-1] != "_":
            out.append("_")
    return "".join(out)[:limit]


def _printable(value: str, limit: int) -> str:
    if len(value) > limit or not value.isprintable():
        raise ValueError(f"must be at most {limit} printable characters")
    return value


def _label(value: str, limit: int) -> str:
    return label_value(_printable(value, limit), limit)


class HelloMessage(BaseModel):
    """Validated HELLO record (keys: :data:`trainmon_client._protocol.HELLO_FIELDS`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    run: str
    rank: int = Field(ge=0, le=1 << 20)
    local_rank: int = Field(ge=0, le=1 << 20)
    world_size: int = Field(ge=1, le=1 << 20)
    hostname: str = ""
    pid: int = Field(0, ge=0)
    client_version: str = ""
    gpu_uuid: str | None = None
    started_at: float = Field(0.0, allow_inf_nan=False)
    flops_per_token: float | None = Field(None, gt=0, allow_inf_nan=False)
    dtype: str = "bf16"
    namespace: str = ""
    pod: str = ""

    @field_validator("namespace", "pod", mode="before")
    @classmethod
    def _absent(cls, v: object) -> object:
        return "" if v is None else v  # null: not in a pod, as when the key is left out

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if v and not N.valid_namespace(v):
            raise ValueError("namespace is not a Kubernetes namespace name (RFC 1123 label)")
        return v

    @field_validator("pod")
    @classmethod
    def _pod(cls, v: str) -> str:
        if v and not N.valid_pod(v):
            raise ValueError("pod is not a Kubernetes pod name (RFC 1123 subdomain)")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return _label(v, 16).lower()

    @field_validator("run")
    @classmethod
    def _run(cls, v: str) -> str:
        if not N.valid_run_id(v):
            raise ValueError("invalid run id")
        return v

    @field_validator("hostname")
    @classmethod
    def _hostname(cls, v: str) -> str:
        return _label(v, 253)

    @field_validator("client_version")
    @classmethod
    def _version(cls, v: str) -> str:
        return _label(v, 64)

    @field_validator("gpu_uuid")
    @classmethod
    def _uuid(cls, v: str | None) -> str | None:
        return None if v is None else _label(v, 96)


def checked_hello(raw: object) -> dict[str, object]:
    """A HELLO (of the state file) checked as one from the wire; ``ValueError`` if refused."""
    return HelloMessage.model_validate(raw).model_dump()


class Link:
    """What applying records knows of one trainer connection.

    Its peer (``SO_PEERCRED``; each None where the kernel does not say), the namespace and
    name of the peer's pod as the node tells them (:mod:`trainmon_exporter.peers`; ``""``
    unknown), its tenant (that namespace, else the uid), whether the socket's allow-lists
    admit that peer, the rank its HELLO bound it to, the names its NAME records bound, whether
    it sent FINISH, and its delivery accounting: data records applied from it, and the gap
    last computed from its TOTALS (:meth:`RankState.observe_totals`).
    """

    __slots__ = (
        "admitted",
        "applied",
        "finished",
        "gap",
        "names",
        "peer_gid",
        "peer_namespace",
        "peer_pid",
        "peer_pod",
        "peer_uid",
        "refusal",
        "state",
        "tenant",
    )

    def __init__(
        self,
        peer_pid: int | None = None,
        peer_uid: int | None = None,
        peer_gid: int | None = None,
        peer_namespace: str = "",
        peer_pod: str = "",
    ) -> None:
        self.peer_pid, self.peer_uid, self.peer_gid = peer_pid, peer_uid, peer_gid
        self.peer_namespace, self.peer_pod = peer_namespace, peer_pod
        self.tenant: Tenant = tenant_of(peer_namespace, peer_uid)
        self.admitted = True
        self.state: RankState | None = None
        self.names: dict[int, str] = {}
        self.finished = False
        self.applied = 0
        self.gap = 0
        self.refusal: str | None = None  # why its HELLO was refused (told to the client)


class Packet:
    """A packet being applied (:meth:`Applier.begin`, :meth:`Applier.resume`).

    Attributes:
        records: the records not applied yet (``_protocol.iter_records``).
        close: whether the connection must close once the packet is done.
    """

    __slots__ = ("close", "records")

    def __init__(self, records: Iterator[tuple[int, memoryview]], close: bool) -> None:
        self.records = records
        self.close = close


class StampedCounter:
    """A labelled counter whose every increment also sets a gauge to the time (Unix s).

    For ``trainmon_ingest_messages_invalid_total`` and its
    ``..._last_timestamp_seconds``: the gauge's series of a label set appears with the first
    increment (never at 0), as alerts on ``time() - gauge`` want.
    """

    def __init__(self, counter: Counter, last: Gauge) -> None:
        self.counter = counter
        self.last = last

    def labels(self, *values: str) -> _StampedChild:
        """The child of ``values`` (``inc()`` counts and stamps)."""
        return _StampedChild(self.counter.labels(*values), self.last, values)


class _StampedChild:
    __slots__ = ("_child", "_last", "_values")

    def __init__(self, child: Counter, last: Gauge, values: tuple[str, ...]) -> None:
        self._child, self._last, self._values = child, last, values

    def inc(self, amount: float = 1) -> None:
        self._child.inc(amount)
        self._last.labels(*self._values).set(time.time())


class Applier:
    """Applies packets to a :class:`Store`, counting what it refuses and drops.

    Args:
        store: where rank state lives; a packet applies under its lock.
        invalid: ``trainmon_ingest_messages_invalid_total`` (label ``reason``), stamped with
            the time of its last increment where it is a :class:`StampedCounter`.
        applied: ``trainmon_ingest_messages_total`` (label ``type``).
        dropped: ``trainmon_ingest_values_dropped_total`` (label ``reason``).
    """

    def __init__(
        self,
        store: Store,
        invalid: Counter | StampedCounter,
        applied: Counter,
        dropped: Counter,
    ) -> None:
        self.store = store
        self._invalid: dict[str, Counter | _StampedChild] = {
            r: invalid.labels(r) for r in (*P.PROTOCOL_ERRORS, *REFUSALS)
        }
        self._invalid[INTERNAL_ERROR] = invalid.labels(INTERNAL_ERROR)
        self._applied = {t: applied.labels(name) for t, name in P.RECORD_NAMES.items()}
        self._dropped = dropped
        self._drop = self.drop  # bound once: STEP records pass it on the hot path

    def packet(self, link: Link, data: bytes) -> bool:
        """Apply one packet's records in order; never raises.

        Returns:
            True when the connection must close (its HELLO was refused, or its rank was
            taken away for its run's owner claim; the records after that in the packet are
            counted as ``no_hello``, not applied).
        """
        pending = self.begin(link, data)
        self.resume(link, pending)
        return pending.close

    def begin(self, link: Link, data: bytes) -> Packet:
        """A packet about to be applied by :meth:`resume` (nothing is applied yet)."""
        # A rank the store took away (its run's owner claim or namespace, or to make room for
        # a tenant below its fair share): the connection closes, its records counted as
        # no_hello.
        revoked = link.state.revoked if link.state is not None else None
        if revoked:
            link.refusal = revoked
        return Packet(P.iter_records(data), bool(revoked))

    def resume(self, link: Link, packet: Packet, deadline: float = math.inf) -> bool:
        """Apply ``packet``'s records in order until it is done or ``deadline`` has passed.

        At least one record is applied per call. The store's lock is held for the call, not
        for the whole packet, so a large packet applied in several calls lets a scrape (and,
        through the caller, the event loop) in between; the records stay in their order
        because only this connection resumes its packet. Never raises.

        Args:
            link: the packet's connection.
            packet: from :meth:`begin`.
            deadline: a :func:`time.perf_counter` time after which no further record starts.

        Returns:
            True when the packet is done (then ``packet.close`` says whether the connection
            must close); False when records are left for the next call.
        """
        invalid = self._invalid
        counts: dict[int, int] = {}
        applied, data_records = Outcome.APPLIED, P.DATA_RECORDS
        records = packet.records
        done = True
        with self.store.lock:
            try:
                for rtype, payload in records:
                    if packet.close:
                        invalid["no_hello"].inc()
                        continue
                    try:
                        outcome = self._record(link, rtype, payload)
                    except Refused as exc:
                        invalid[exc.reason].inc()
                        outcome = Outcome.CLOSE if exc.reason in FATAL else Outcome.SKIPPED
                        if outcome is Outcome.CLOSE:
                            self._count_refused(link, exc.reason)
                    except P.ProtocolError as exc:
                        invalid[exc.reason].inc()
                        outcome = Outcome.CLOSE if rtype == P.HELLO else Outcome.SKIPPED
                        if outcome is Outcome.CLOSE:
                            self._count_refused(link, exc.reason)
                    except Exception:  # a bug or a value nobody foresaw: this record only
                        invalid[INTERNAL_ERROR].inc()
                        log.exception(
                            "ingest: a %s record raised", P.RECORD_NAMES.get(rtype, rtype)
                        )
                        outcome = Outcome.SKIPPED
                    if outcome is applied:
                        counts[rtype] = counts.get(rtype, 0) + 1
                        if rtype in data_records:
                            link.applied += 1
                    elif outcome is Outcome.CLOSE:
                        packet.close = True
                    if time.perf_counter() >= deadline:
                        done = False
                        break
            except P.ProtocolError as exc:  # the packet's header, or a record cut short
                invalid[exc.reason].inc()
        for rtype, n in counts.items():
            self._applied[rtype].inc(n)
        return done

    def _count_refused(self, link: Link, reason: str) -> None:
        self.store.admission.count_refused_hello(reason, link.peer_uid, link.peer_namespace)

    def drop(self, reason: str, n: int) -> None:
        """Count ``n`` values dropped for ``reason`` (a :data:`~.state.rank.Drop`)."""
        self._dropped.labels(reason).inc(n)

    def _record(self, link: Link, rtype: int, payload: memoryview) -> Outcome:
        """Check, decode and apply one record (raises :class:`Refused` or ``ProtocolError``).

        What the connection may send is checked before the record is decoded, so a HELLO on
        a connection that has one is ``duplicate_hello`` and a record before any HELLO
        ``no_hello``, whatever their content.
        """
        state = link.state
        if rtype == P.HELLO:
            if state is not None:
                raise Refused("duplicate_hello")
            if not link.admitted:
                log.warning(
                    "refused a trainer of uid %s gid %s (pid %s): not in allowed_uids/allowed_gids",
                    link.peer_uid,
                    link.peer_gid,
                    link.peer_pid,
                )
                link.refusal = "peer_not_allowed"
                raise Refused("peer_not_allowed")
        elif state is None and rtype in P.RECORD_NAMES:
            raise Refused("no_hello")
        record = P.decode_record(rtype, payload)
        if state is None:  # only a HELLO gets here without a rank
            assert isinstance(record, P.Hello)
            return self._hello(link, record)
        match record:
            case P.Step():
                self.store.observe_step(state, record, link.names, self._drop)
            case P.Totals():
                link.gap = state.observe_totals(record, link.applied, link.gap)
            case P.Name():
                self._name(link, record)
            case P.Layers():
                self.store.observe_layers(state, record, link.names, self._drop)
            case P.Eval():
                self.store.observe_eval(state, record, link.names, self._drop)
            case P.Track():
                if not self.store.observe_track(state, record, link.names, self._drop):
                    return Outcome.SKIPPED
            case P.Checkpoint():
                state.observe_checkpoint(record)
            case P.Finish():
                state.finish(record.status)
                link.finished = True
            case P.Capture():  # the answer to a request for a hung rank's stacks
                if not self.store.observe_capture(state, record):
                    return Outcome.SKIPPED
            case P.Hello():  # not reached: refused above, before decoding
                raise Refused("duplicate_hello")
        return Outcome.APPLIED

    def _name(self, link: Link, record: P.Name) -> None:
        if not N.valid_name(record.name):
            raise Refused("invalid_name")
        if record.field_id not in link.names and len(link.names) >= MAX_NAMES_PER_CONNECTION:
            raise Refused("name_cap")
        link.names[record.field_id] = record.name

    def _hello(self, link: Link, record: P.Hello) -> Outcome:
        raw = record.fields
        try:
            hello = HelloMessage.model_validate(raw)
        except ValidationError as exc:
            log.warning("refused HELLO: %s", exc.errors()[0].get("msg", "invalid"))
            link.refusal = "bad_hello"
            raise Refused("bad_hello") from None
        extra = sum(1 for k in raw if k not in HelloMessage.model_fields)
        if extra:
            self.drop("unknown_hello_key", extra)
        rewritten = sum(
            1
            for k in LABEL_FIELDS
            if isinstance(v := raw.get(k), str) and v.lower() != str(getattr(hello, k)).lower()
        )
        if rewritten:
            log.warning(
                "run %s rank %d from uid %s: %d label value(s) with characters outside "
                "letters, digits and . _ - : / + were rewritten",
                hello.run,
                hello.rank,
                link.peer_uid,
                rewritten,
            )
            self.drop("label_rewritten", rewritten)
        self._verified(link, hello)
        key = self.store.key_of(hello.namespace, hello.run)
        before = self.store.run_state(key)
        result = self.store.attach(
            hello.model_dump(), link.peer_uid, link.peer_pid, link.peer_namespace
        )
        if before is not None and before.revoked:
            log.warning(
                "run %s: it belongs to %s (its owner claim, or its namespace's pods); the "
                "ranks %s opened before it were dropped",
                key,
                describe_tenant(link.tenant),
                describe_tenant(before.tenant),
            )
        link.refusal = result if isinstance(result, str) else None
        if isinstance(result, str):
            if result == "not_owner":
                log.warning(
                    "refused run %s rank %d from %s (uid %s): the run belongs to %s",
                    key,
                    hello.rank,
                    describe_tenant(link.tenant),
                    link.peer_uid,
                    describe_tenant(self.store.owner_of(key)),
                )
            else:
                log.warning(
                    "refused run %s rank %d from %s (uid %s): %s",
                    key,
                    hello.rank,
                    describe_tenant(link.tenant),
                    link.peer_uid,
                    result,
                )
            raise Refused(result)
        link.state = result
        # The client re-sends every NAME after HELLO; forget what an earlier connection bound.
        link.names = {}
        return Outcome.APPLIED

    def _verified(self, link: Link, hello: HelloMessage) -> None:
        """Hold ``hello`` to the pod the node places its sender in, where it is known.

        A namespace other than the pod's is refused (``namespace_mismatch``); none becomes the
        pod's. The pod's name replaces the one the HELLO gives (``pod_rewritten`` when it gave
        another).
        """
        if not link.peer_namespace:
            return
        if hello.namespace and hello.namespace != link.peer_namespace:
            log.warning(
                "refused run %s rank %d from uid %s (pid %s): it claims namespace %s, its pod "
                "%s is in namespace %s",
                hello.run,
                hello.rank,
                link.peer_uid,
                link.peer_pid,
                hello.namespace,
                link.peer_pod,
                link.peer_namespace,
            )
            link.refusal = "namespace_mismatch"
            raise Refused("namespace_mismatch")
        hello.namespace = link.peer_namespace
        if link.peer_pod and hello.pod != link.peer_pod:
            if hello.pod:
                self.drop("pod_rewritten", 1)
            hello.pod = link.peer_pod
