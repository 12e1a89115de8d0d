"""The trainmon wire protocol: one definition, shared by the client and the exporter.

Why this module is one module of about 700 lines: it is the protocol's specification as
well as its code. Every record's layout, units and clock are documented next to the struct
that writes it and the function that reads it, for both sides; splitting encoders from
decoders would put the two halves of one definition in two files.

Transport: a ``SOCK_SEQPACKET`` Unix socket. Every ``send()`` is one *packet*; the kernel keeps
packet boundaries, so no stream framing is needed, and the exporter sees EOF the moment a
trainer process dies (which is how it tells "crashed" from "finished": a clean end sends a
FINISH record first).

Packet layout (little endian)::

    packet  := header record*
    header  := magic "TM" (2 bytes) | version u8 | flags u8 (reserved, 0)
    record  := type u8 | payload_length u16 | payload

A packet is at most :data:`MAX_PACKET_BYTES` bytes. Record types:

``HELLO`` (1)
    UTF-8 JSON object identifying the sender; the first record on every connection. Keys are
    listed in :data:`HELLO_FIELDS`.
``NAME`` (2)
    ``id u16 | utf-8 name``: binds a custom metric name to a field id (``id >= FIRST_CUSTOM_ID``)
    for the rest of the connection. A client re-sends all its names after every (re)connect.
``STEP`` (3)
    :data:`STEP_HEADER` then ``n`` field ids (u16 each) then ``n`` values (f64 each). ``n`` is
    implied by the payload length: ``(length - STEP_HEADER.size) / 10``.
``FINISH`` (4)
    ``status u8 (0 = finished, 1 = failed with an exception) | time f64`` — a clean end.
``EVAL`` (5)
    :data:`EVAL_HEADER` (step, time) then field ids and values laid out as in STEP: the
    results of one evaluation (``val_loss`` and any named metric).
``TRACK`` (6)
    :data:`TRACK_BODY`: a monitoring operation (``Run.track``): its NAME id, whether it is
    running now, and its cumulative seconds and count.
``CHECKPOINT`` (7)
    :data:`CHECKPOINT_BODY`: step, time it completed (Unix s), seconds it took (NaN unknown);
    a restore (a checkpoint loaded) adds one byte of :data:`CHECKPOINT_FLAGS`
    (:data:`CHECKPOINT_RESTORE`). A save is sent without it, as before, so only restores
    need an exporter that knows the byte (one that predates it counts the record
    ``truncated`` and applies the rest of the packet): upgrade exporters before clients.
``LAYERS`` (8)
    :data:`LAYERS_HEADER` then ``n_stats`` stat codes (u8), ``n_layers`` layer NAME ids (u16)
    and ``n_layers x n_stats`` values (f64, row per layer): one ``Run.watch`` check.
``TOTALS`` (9)
    :data:`TOTALS_BODY`: the client's delivery accounting, last in every packet that carries
    data. With it the exporter tells records it never received from records it applied (the
    gap is ``sent_connection`` less what it applied from that connection). Added without a
    version bump: an exporter that predates it counts one ``unknown_type`` per packet and
    applies the rest, so upgrade exporters before clients.
``REFUSED`` (10), exporter to client
    ``reason_length u8 | reason ascii | detail utf-8``: why the exporter refused this
    connection's HELLO (a reason of its refusals: ``not_owner``, ``duplicate_rank``...), sent in
    a packet of its own just before it closes the connection; ``detail`` (at most
    :data:`MAX_REFUSAL_DETAIL` bytes) may be empty. The only record that travels this way. An
    exporter that predates it sends nothing; a client that predates it never reads.
``CAPTURE_REQUEST`` (11), exporter to client
    :data:`CAPTURE_REQUEST_BODY`, in a packet of its own on a live connection: the rank was
    judged hung; send its stacks and collective state (docs/hangs.md). A client that predates
    it never reads while connected, so never answers: the exporter says so after its wait.
``CAPTURE`` (12)
    ``request_id u32 | utf-8 JSON object`` (:data:`CAPTURE_FIELDS`): the answer, in a packet
    of its own (no TOTALS: not a data record). Only sent when asked.

*Data records* are STEP, EVAL, TRACK, CHECKPOINT and LAYERS: what the client's sent and
dropped totals count.

All counters in STEP are cumulative since the client process started (never deltas), so a
dropped packet or an exporter restart loses no totals.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterator
from typing import Any, Final, NamedTuple, Union

PROTOCOL_VERSION: Final = 1
MAGIC: Final = b"TM"
MAX_STEP: Final = 2**64 - 1
"""Largest step number (u64 in STEP, EVAL, CHECKPOINT and LAYERS records)."""
MAX_PACKET_BYTES: Final = 65536
"""Upper bound of one packet, header included (bytes)."""

PACKET_HEADER: Final = struct.Struct("<2sBB")
RECORD_HEADER: Final = struct.Struct("<BH")

HELLO: Final = 1
NAME: Final = 2
STEP: Final = 3
FINISH: Final = 4
EVAL: Final = 5
TRACK: Final = 6
CHECKPOINT: Final = 7
LAYERS: Final = 8
TOTALS: Final = 9
REFUSED: Final = 10
"""Exporter to client only: not in :data:`RECORD_NAMES`, which are what a client sends."""
CAPTURE_REQUEST: Final = 11
"""Exporter to client only, as :data:`REFUSED`: the rank is hung, send its stacks."""
CAPTURE: Final = 12
"""The client's answer to a :data:`CAPTURE_REQUEST` (not a data record)."""
MAX_REFUSAL_DETAIL: Final = 256
"""Most bytes of a REFUSED record's ``detail``."""
DATA_RECORDS: Final = frozenset({STEP, EVAL, TRACK, CHECKPOINT, LAYERS})
"""Record types the client's sent and dropped totals count (one each)."""
RECORD_NAMES: Final[dict[int, str]] = {
    HELLO: "hello",
    NAME: "name",
    STEP: "step",
    FINISH: "finish",
    EVAL: "eval",
    TRACK: "track",
    CHECKPOINT: "checkpoint",
    LAYERS: "layers",
    TOTALS: "totals",
    CAPTURE: "capture",
}
"""Lower-case name of every record type (the exporter's ``type`` label values)."""

STEP_HEADER: Final = struct.Struct("<QQdddddQQQ")
"""STEP payload header: step, steps_total, time, step_time, tokens_total, samples_total,
overhead_seconds_total, dropped_disconnected_total, dropped_backpressure_total,
refused_values_total.

- ``step``: the caller's step number (u64).
- ``steps_total``: steps this client process has logged so far, this one included (u64).
- ``time``: wall-clock time of the ``log()`` call, Unix seconds (the call's
  ``time.perf_counter()`` mapped to ``time.time()`` when the step is encoded).
- ``step_time``: seconds since the previous ``log()`` call of this process
  (``time.perf_counter()`` difference); NaN for the first step.
- ``tokens_total`` / ``samples_total``: cumulative sums of the per-step ``tokens`` / ``samples``.
- ``overhead_seconds_total``: cumulative seconds the client cost the training process: wall
  time inside its calls plus the CPU time of its flusher thread.
- ``dropped_disconnected_total`` / ``dropped_backpressure_total``: cumulative steps the client
  dropped because no exporter was connected, or because the socket buffer was full.
- ``refused_values_total``: cumulative values (or whole records) the client refused: a bad
  metric name, a value that is not a real scalar, a bad step, or a name past its name cap.
"""


class StepHeader(NamedTuple):
    """A decoded :data:`STEP_HEADER` (units and meaning: see :data:`STEP_HEADER`)."""

    step: int
    steps_total: int
    time: float
    step_time: float
    tokens_total: float
    samples_total: float
    overhead_seconds_total: float
    dropped_disconnected_total: int
    dropped_backpressure_total: int
    refused_values_total: int


FIELD_ID: Final = "H"
FIELD_VALUE: Final = "d"
FIELD_BYTES: Final = 10  # u16 id + f64 value
FINISH_BODY: Final = struct.Struct("<Bd")
EVAL_HEADER: Final = struct.Struct("<Qd")
TRACK_BODY: Final = struct.Struct("<HBdQ")
"""TRACK payload: name id u16, active u8 (1 while the operation runs), seconds_total f64
(cumulative wall time of finished runs of it), count u64 (finished runs)."""
CHECKPOINT_BODY: Final = struct.Struct("<Qdd")
CHECKPOINT_FLAGS: Final = struct.Struct("<B")
"""Optional byte after :data:`CHECKPOINT_BODY`; absent means 0 (a save)."""
CHECKPOINT_RESTORE: Final = 1
"""Flag: the checkpoint of ``step`` was loaded (the run resumes from it), not saved."""
STAT_GRAD_NORM: Final = 1
STAT_GRAD_MEAN: Final = 2
STAT_GRAD_STD: Final = 3
STAT_WEIGHT_NORM: Final = 4
STAT_UPDATE_RATIO: Final = 5
STAT_ACTIVATION_MEAN: Final = 6
STAT_ACTIVATION_STD: Final = 7
STAT_DEAD_RATIO: Final = 8
LAYER_STATS: Final[dict[str, int]] = {
    "grad_norm": STAT_GRAD_NORM,
    "grad_mean": STAT_GRAD_MEAN,
    "grad_std": STAT_GRAD_STD,
    "weight_norm": STAT_WEIGHT_NORM,
    "update_ratio": STAT_UPDATE_RATIO,
    "activation_mean": STAT_ACTIVATION_MEAN,
    "activation_std": STAT_ACTIVATION_STD,
    "dead_ratio": STAT_DEAD_RATIO,
}
"""Stat codes of LAYERS records; codes ``QUANTILE_CODE0 + i`` are the ``LAYER_QUANTILES[i]``
quantile of the layer's gradient values."""
LAYER_QUANTILES: Final = (0.0, 0.25, 0.5, 0.75, 0.95, 0.99, 1.0)
QUANTILE_CODE0: Final = 16
LAYERS_HEADER: Final = struct.Struct("<QdQdHB")
"""LAYERS payload header: optimizer step u64, time f64, checks_total u64 (watch checks so
far), seconds_total f64 (their cumulative cost), n_layers u16, n_stats u8."""
NAME_ID: Final = struct.Struct("<H")
TOTALS_BODY: Final = struct.Struct("<7Q")
"""TOTALS payload, cumulative counts of data records since the client process started (u64):

- ``sent_connection``: records handed to the kernel on *this* connection, the packet that
  carries this record included (0 again after every reconnect).
- ``sent_total``: records handed to the kernel over every connection.
- ``dropped_disconnected``: dropped with no exporter connected (or the send failed for good).
- ``dropped_backpressure``: dropped because the socket buffer was full (or ``finish()`` ran
  out of its deadline).
- ``dropped_encode_error``: steps that could not be encoded (a value out of range).
- ``dropped_in_flight``: records sent on a connection that ended before the exporter was seen
  to read them (the client's socket queue never drained after they were sent): an upper bound
  of what an exporter that was frozen, killed or restarted never read.
- ``refused_values``: as ``refused_values_total`` in STEP.
"""


CAPTURE_REQUEST_BODY: Final = struct.Struct("<II")
"""CAPTURE_REQUEST payload: ``request_id`` (u32, the exporter's, echoed in the answer) and
``max_bytes`` (u32, the most bytes of JSON the answer may carry)."""
CAPTURE_ID: Final = struct.Struct("<I")
"""The ``request_id`` that starts a CAPTURE payload."""
MAX_CAPTURE_BYTES: Final = (
    MAX_PACKET_BYTES - PACKET_HEADER.size - RECORD_HEADER.size - CAPTURE_ID.size
)
"""Most bytes of JSON one CAPTURE carries: a packet less its and the record's headers and id."""
CAPTURE_FIELDS: Final = ("time", "seconds", "threads", "threads_omitted", "collectives", "notes")
"""Keys of a CAPTURE's JSON object, each optional: every thread's stack, the Flight Recorder's
state per process group, what could not be captured (specified in docs/hangs.md and
:mod:`trainmon_client._capture`, which writes them)."""


class CaptureRequest(NamedTuple):
    """A decoded CAPTURE_REQUEST (see :data:`CAPTURE_REQUEST_BODY`)."""

    request_id: int
    max_bytes: int


class Totals(NamedTuple):
    """A decoded :data:`TOTALS_BODY` (meaning: see there)."""

    sent_connection: int
    sent_total: int
    dropped_disconnected: int
    dropped_backpressure: int
    dropped_encode_error: int
    dropped_in_flight: int
    refused_values: int


FINISH_OK: Final = 0
FINISH_FAILED: Final = 1

FIELD_LOSS: Final = 1
FIELD_LR: Final = 2
FIELD_GRAD_NORM: Final = 3
FIELD_BATCH_SIZE: Final = 4
FIELD_SEQ_LEN: Final = 5
FIELD_VAL_LOSS: Final = 6
FIELD_MEM_ALLOCATED: Final = 7
FIELD_MEM_RESERVED: Final = 8
FIELD_MEM_PEAK: Final = 9
FIELD_ALLOC_RETRIES: Final = 10
FIELD_OOMS: Final = 11
FIELD_DATA_TIME: Final = 12
FIELD_DATA_TIME_TOTAL: Final = 13
FIELD_CHECKPOINT_STEP: Final = 14
FIELD_CHECKPOINT_TIME_TOTAL: Final = 15
STANDARD_FIELDS: Final[dict[str, int]] = {
    "loss": FIELD_LOSS,
    "lr": FIELD_LR,
    "grad_norm": FIELD_GRAD_NORM,
    "batch_size": FIELD_BATCH_SIZE,
    "seq_len": FIELD_SEQ_LEN,
    "val_loss": FIELD_VAL_LOSS,
    "mem_allocated": FIELD_MEM_ALLOCATED,
    "mem_reserved": FIELD_MEM_RESERVED,
    "mem_peak": FIELD_MEM_PEAK,
    "alloc_retries": FIELD_ALLOC_RETRIES,
    "ooms": FIELD_OOMS,
    "data_time": FIELD_DATA_TIME,
    "data_time_total": FIELD_DATA_TIME_TOTAL,
    "checkpoint_step": FIELD_CHECKPOINT_STEP,
    "checkpoint_time_total": FIELD_CHECKPOINT_TIME_TOTAL,
}
"""Field ids of the standard scalars. ``tokens`` and ``samples`` are not fields: the client
adds them to the cumulative totals in the STEP header.

The last three are cumulative, for the time accounting, added by the client's encoder (not
by ``log()``'s caller) so that a STEP lost with its exporter loses none of them:
``data_time_total`` (the process's ``data_time`` so far, in every STEP that carries a
``data_time``), ``checkpoint_step`` and ``checkpoint_time_total`` (the last checkpoint the
process saved and its saves' seconds so far, in every STEP after its first save). Added
without a version bump: an exporter that predates them counts each as ``unknown_field`` and
applies the rest of the STEP, so upgrade exporters before clients."""
STANDARD_NAMES: Final[dict[int, str]] = {v: k for k, v in STANDARD_FIELDS.items()}
FIRST_CUSTOM_ID: Final = 64
MAX_FIELD_ID: Final = 0xFFFF

HELLO_FIELDS: Final = (
    "run",
    "rank",
    "local_rank",
    "world_size",
    "hostname",
    "pid",
    "client_version",
    "gpu_uuid",
    "started_at",
    "flops_per_token",
    "dtype",
    "namespace",
    "pod",
)
"""Keys of the HELLO object: run id (str), rank / local_rank / world_size (int), hostname (str),
pid (int, the client's own PID namespace), client_version (str), gpu_uuid (str or null, the CUDA
device's UUID as NVML prints it), started_at (Unix seconds), flops_per_token (float or null),
dtype (str: the training dtype MFU is judged against: bf16, fp16, fp8, tf32 or fp32), namespace
and pod (str: the Kubernetes namespace and pod of a client in a pod, see
:func:`trainmon_client._env.detect_pod`). A client sends namespace and pod only when it has
them, so a HELLO off Kubernetes is what exporters that predate them know; one that predates
them ignores them and counts each as ``unknown_hello_key``: upgrade exporters before clients."""

PROTOCOL_ERRORS: Final = (
    "oversized",
    "truncated",
    "bad_magic",
    "unknown_version",
    "unknown_type",
    "malformed",
)
"""Every ``reason`` a :class:`ProtocolError` carries: a packet over :data:`MAX_PACKET_BYTES`;
a packet or record shorter than its layout; a packet not starting with :data:`MAGIC`; another
:data:`PROTOCOL_VERSION`; a record type this version does not define; a record whose content
breaks its rules (bad UTF-8 or JSON, a reserved id, an unknown status, a bad time)."""


class ProtocolError(ValueError):
    """A packet or record that does not follow the protocol.

    Attributes:
        reason: a short, bounded token used as the ``reason`` label of
            ``trainmon_ingest_messages_invalid_total`` (e.g. ``"truncated"``).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in PROTOCOL_ERRORS:
            raise ValueError(f"not a protocol error reason: {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def packet_header() -> bytes:
    """The 4-byte header that starts every packet."""
    return PACKET_HEADER.pack(MAGIC, PROTOCOL_VERSION, 0)


def encode_hello(fields: dict[str, Any]) -> bytes:
    """Encode a HELLO record (record header included).

    Raises:
        ValueError: the JSON does not fit in one record.
    """
    body = json.dumps(fields, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MAX_PACKET_BYTES - PACKET_HEADER.size - RECORD_HEADER.size:
        raise ValueError("HELLO too large")
    return RECORD_HEADER.pack(HELLO, len(body)) + body


def encode_name(field_id: int, name: str) -> bytes:
    """Encode a NAME record binding ``field_id`` to ``name`` (record header included)."""
    body = NAME_ID.pack(field_id) + name.encode()
    return RECORD_HEADER.pack(NAME, len(body)) + body


def encode_finish(status: int, when: float) -> bytes:
    """Encode a FINISH record: ``status`` is :data:`FINISH_OK` or :data:`FINISH_FAILED`."""
    return RECORD_HEADER.pack(FINISH, FINISH_BODY.size) + FINISH_BODY.pack(status, when)


class Refusal(NamedTuple):
    """A decoded REFUSED record: ``reason`` (a short token, ``[a-z_]``), ``detail`` (free text)."""

    reason: str
    detail: str


_REASON_RE: Final = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")


def encode_refused(reason: str, detail: str = "") -> bytes:
    """A whole packet (header included) holding one REFUSED record.

    Args:
        reason: 1 to 32 of lower-case letters, digits and ``_``, a letter first.
        detail: cut to :data:`MAX_REFUSAL_DETAIL` bytes of UTF-8.

    Raises:
        ValueError: ``reason`` breaks its rule.
    """
    if _REASON_RE.match(reason) is None:
        raise ValueError(f"not a refusal reason token: {reason!r}")
    raw = detail.encode()[:MAX_REFUSAL_DETAIL]
    body = bytes((len(reason),)) + reason.encode() + raw
    return packet_header() + RECORD_HEADER.pack(REFUSED, len(body)) + body


def decode_refused(packet: bytes) -> Refusal | None:
    """The REFUSED record in a packet the exporter sent, or None.

    None: no such record, another version, or a record that breaks its layout (nothing an
    exporter sends ever raises here).

    ``detail`` is decoded with replacement characters and stripped of control characters, so
    it can be printed as it is.
    """
    try:
        for rtype, payload in iter_records(packet):
            if rtype != REFUSED or len(payload) < 2:
                continue
            n = payload[0]
            reason = bytes(payload[1 : 1 + n]).decode("ascii", "replace")
            if len(payload) < 1 + n or _REASON_RE.match(reason) is None:
                return None
            raw = bytes(payload[1 + n : 1 + n + MAX_REFUSAL_DETAIL])
            detail = "".join(c for c in raw.decode("utf-8", "replace") if c.isprintable())
            return Refusal(reason, detail)
    except ProtocolError:
        return None
    return None


def encode_capture_request(request_id: int, max_bytes: int) -> bytes:
    """A whole packet holding one CAPTURE_REQUEST (``struct.error`` outside a u32)."""
    body = CAPTURE_REQUEST_BODY.pack(request_id, max_bytes)
    return packet_header() + RECORD_HEADER.pack(CAPTURE_REQUEST, len(body)) + body


def decode_capture_requests(packet: bytes) -> list[CaptureRequest]:
    """The CAPTURE_REQUEST records in a packet the exporter sent; never raises ([] if none)."""
    out: list[CaptureRequest] = []
    try:
        for rtype, payload in iter_records(packet):
            if rtype == CAPTURE_REQUEST and len(payload) == CAPTURE_REQUEST_BODY.size:
                out.append(CaptureRequest._make(CAPTURE_REQUEST_BODY.unpack_from(payload, 0)))
    except ProtocolError:
        pass
    return out


def encode_capture(request_id: int, body: bytes) -> bytes:
    """A CAPTURE record answering ``request_id`` with JSON ``body`` (record header included).

    Raises ``ValueError`` when ``body`` is over :data:`MAX_CAPTURE_BYTES`.
    """
    if len(body) > MAX_CAPTURE_BYTES:
        raise ValueError("CAPTURE too large")
    payload = CAPTURE_ID.pack(request_id) + body
    return RECORD_HEADER.pack(CAPTURE, len(payload)) + payload


_step_structs: dict[int, struct.Struct] = {}


def step_struct(n_fields: int) -> struct.Struct:
    """The cached :class:`struct.Struct` of a whole STEP record with ``n_fields`` fields.

    Its ``pack`` takes ``(STEP, payload_length, *STEP_HEADER values, *ids, *values)``.
    """
    s = _step_structs.get(n_fields)
    if s is None:
        s = struct.Struct(
            "<BH" + STEP_HEADER.format[1:] + FIELD_ID * n_fields + FIELD_VALUE * n_fields
        )
        _step_structs[n_fields] = s
    return s


def encode_fields(rtype: int, head: bytes, ids: list[int], values: list[float]) -> bytes:
    """A record made of a fixed ``head`` then ``ids`` (u16 each) and ``values`` (f64 each)."""
    n = len(ids)
    body = head + struct.pack(f"<{n}{FIELD_ID}{n}{FIELD_VALUE}", *ids, *values)
    return RECORD_HEADER.pack(rtype, len(body)) + body


def encode_totals(totals: Totals) -> bytes:
    """Encode a TOTALS record (record header included).

    Raises:
        struct.error: a count outside 0 .. 2**64 - 1.
    """
    return RECORD_HEADER.pack(TOTALS, TOTALS_BODY.size) + TOTALS_BODY.pack(*totals)


def decode_totals(payload: memoryview) -> Totals:
    """Decode a TOTALS payload.

    Raises:
        ProtocolError: ``truncated``.
    """
    if len(payload) != TOTALS_BODY.size:
        raise ProtocolError("truncated", "TOTALS")
    return Totals._make(TOTALS_BODY.unpack_from(payload, 0))


def encode_track(field_id: int, active: bool, seconds_total: float, count: int) -> bytes:
    """Encode a TRACK record (record header included)."""
    return RECORD_HEADER.pack(TRACK, TRACK_BODY.size) + TRACK_BODY.pack(
        field_id, 1 if active else 0, seconds_total, count
    )


def encode_checkpoint(step: int, when: float, seconds: float, restore: bool = False) -> bytes:
    """Encode a CHECKPOINT record (record header included); ``restore``: a load, not a save."""
    body = CHECKPOINT_BODY.pack(step, when, seconds)
    if restore:
        body += CHECKPOINT_FLAGS.pack(CHECKPOINT_RESTORE)
    return RECORD_HEADER.pack(CHECKPOINT, len(body)) + body


def encode_layers(
    step: int,
    when: float,
    checks_total: int,
    seconds_total: float,
    layer_ids: list[int],
    codes: list[int],
    values: list[float],
) -> bytes:
    """Encode a LAYERS record; ``values`` is row-major, ``len(layer_ids) x len(codes)``."""
    n, k = len(layer_ids), len(codes)
    body = LAYERS_HEADER.pack(step, when, checks_total, seconds_total, n, k) + struct.pack(
        f"<{k}B{n}H{n * k}d", *codes, *layer_ids, *values
    )
    return RECORD_HEADER.pack(LAYERS, len(body)) + body


def step_payload_length(n_fields: int) -> int:
    """Payload bytes of a STEP record with ``n_fields`` fields."""
    return STEP_HEADER.size + FIELD_BYTES * n_fields


# ---------------------------------------------------------------------------- typed records


class Hello(NamedTuple):
    """A decoded HELLO: the JSON object as sent (keys: :data:`HELLO_FIELDS`, types unchecked)."""

    fields: dict[str, Any]


class Name(NamedTuple):
    """A decoded NAME: ``field_id`` (>= :data:`FIRST_CUSTOM_ID`) now means ``name``."""

    field_id: int
    name: str


class Step(NamedTuple):
    """A decoded STEP: its header and its fields (ids and f64 values, in the same order)."""

    header: StepHeader
    ids: tuple[int, ...]
    values: tuple[float, ...]


class Finish(NamedTuple):
    """A decoded FINISH: :data:`FINISH_OK` or :data:`FINISH_FAILED`, and when (Unix s)."""

    status: int
    time: float


class Eval(NamedTuple):
    """A decoded EVAL: the training step it belongs to, when (Unix s), and its fields."""

    step: int
    time: float
    ids: tuple[int, ...]
    values: tuple[float, ...]


class Track(NamedTuple):
    """A decoded TRACK (meaning of the fields: :data:`TRACK_BODY`)."""

    field_id: int
    active: bool
    seconds_total: float
    runs_total: int


class Checkpoint(NamedTuple):
    """A decoded CHECKPOINT: step, completion time (Unix s), seconds (NaN: unknown), restore.

    ``restore``: the checkpoint was loaded (the run resumes from ``step``), not saved.
    """

    step: int
    time: float
    seconds: float
    restore: bool = False


class LayersHeader(NamedTuple):
    """The fixed part of a LAYERS record (meaning: :data:`LAYERS_HEADER`)."""

    step: int
    time: float
    checks_total: int
    seconds_total: float


class Layers(NamedTuple):
    """A decoded LAYERS: ``values`` is row-major, one row of ``len(codes)`` per layer id."""

    header: LayersHeader
    codes: tuple[int, ...]
    ids: tuple[int, ...]
    values: tuple[float, ...]


class Capture(NamedTuple):
    """A decoded CAPTURE: request id, JSON object (types unchecked, as Hello's), its bytes."""

    request_id: int
    fields: dict[str, Any]
    size: int


Record = Union[Hello, Name, Step, Finish, Eval, Track, Checkpoint, Layers, Totals, Capture]  # noqa: UP007 (3.9)
"""Any decoded record (:func:`decode_record`)."""


# ---------------------------------------------------------------------------------- decoding


def iter_records(packet: bytes | bytearray | memoryview) -> Iterator[tuple[int, memoryview]]:
    """Split a packet into ``(record type, payload)`` pairs.

    Raises:
        ProtocolError: ``oversized``, ``truncated``, ``bad_magic`` or ``unknown_version`` for the
            packet header (nothing is yielded), ``truncated`` for a record that runs past the end
            (the records before it have been yielded).
    """
    n = len(packet)
    if n > MAX_PACKET_BYTES:
        raise ProtocolError("oversized", f"{n} bytes > {MAX_PACKET_BYTES}")
    if n < PACKET_HEADER.size:
        raise ProtocolError("truncated", "packet shorter than its header")
    magic, version, _flags = PACKET_HEADER.unpack_from(packet, 0)
    if magic != MAGIC:
        raise ProtocolError("bad_magic")
    if version != PROTOCOL_VERSION:
        raise ProtocolError("unknown_version", str(version))
    view = memoryview(packet)
    off = PACKET_HEADER.size
    rh = RECORD_HEADER.size
    while off < n:
        if off + rh > n:
            raise ProtocolError("truncated", "record header")
        rtype, length = RECORD_HEADER.unpack_from(packet, off)
        off += rh
        end = off + length
        if end > n:
            raise ProtocolError("truncated", "record payload")
        yield rtype, view[off:end]
        off = end


def decode_hello(payload: memoryview) -> dict[str, Any]:
    """Decode a HELLO payload to a dict (types are checked by the exporter).

    Raises:
        ProtocolError: ``malformed`` when it is not a UTF-8 JSON object.
    """
    try:
        obj = json.loads(bytes(payload).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError("malformed", f"HELLO is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("malformed", "HELLO is not a JSON object")
    return obj


def decode_name(payload: memoryview) -> Name:
    """Decode a NAME payload to ``(field id, name)``.

    Raises:
        ProtocolError: ``truncated`` or ``malformed`` (bad UTF-8, id below FIRST_CUSTOM_ID).
    """
    if len(payload) < NAME_ID.size + 1:
        raise ProtocolError("truncated", "NAME")
    (field_id,) = NAME_ID.unpack_from(payload, 0)
    if field_id < FIRST_CUSTOM_ID:
        raise ProtocolError("malformed", f"NAME id {field_id} is reserved")
    try:
        name = bytes(payload[NAME_ID.size :]).decode()
    except UnicodeDecodeError:
        raise ProtocolError("malformed", "NAME is not UTF-8") from None
    return Name(field_id, name)


def decode_step(payload: memoryview) -> Step:
    """Decode a STEP payload to ``(header values, field ids, field values)``.

    Raises:
        ProtocolError: ``truncated`` when shorter than the header or not a whole number of fields.
    """
    if len(payload) < STEP_HEADER.size:
        raise ProtocolError("truncated", "STEP")
    ids, values = _decode_fields(payload, STEP_HEADER.size, "STEP")
    return Step(StepHeader._make(STEP_HEADER.unpack_from(payload, 0)), ids, values)


def _decode_fields(
    payload: memoryview, off: int, what: str
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    extra = len(payload) - off
    if extra < 0 or extra % FIELD_BYTES:
        raise ProtocolError("truncated", what)
    n = extra // FIELD_BYTES
    if n == 0:
        return (), ()
    ids = struct.unpack_from(f"<{n}{FIELD_ID}", payload, off)
    values = struct.unpack_from(f"<{n}{FIELD_VALUE}", payload, off + 2 * n)
    return ids, values


def decode_eval(payload: memoryview) -> Eval:
    """Decode an EVAL payload to ``(step, time, field ids, field values)``.

    Raises:
        ProtocolError: ``truncated``.
    """
    if len(payload) < EVAL_HEADER.size:
        raise ProtocolError("truncated", "EVAL")
    step, when = EVAL_HEADER.unpack_from(payload, 0)
    ids, values = _decode_fields(payload, EVAL_HEADER.size, "EVAL")
    return Eval(int(step), float(when), ids, values)


def decode_track(payload: memoryview) -> Track:
    """Decode a TRACK payload to ``(name id, active, seconds_total, count)``.

    Raises:
        ProtocolError: ``truncated`` or ``malformed`` (reserved id, negative or NaN seconds).
    """
    if len(payload) != TRACK_BODY.size:
        raise ProtocolError("truncated", "TRACK")
    field_id, active, seconds, count = TRACK_BODY.unpack_from(payload, 0)
    if field_id < FIRST_CUSTOM_ID or active > 1 or not (0.0 <= seconds < math.inf):
        raise ProtocolError("malformed", "TRACK")
    return Track(int(field_id), bool(active), float(seconds), int(count))


def decode_checkpoint(payload: memoryview) -> Checkpoint:
    """Decode a CHECKPOINT payload to ``(step, time, seconds, restore)``; seconds may be NaN.

    Raises:
        ProtocolError: ``truncated`` or ``malformed`` (time not finite, negative seconds).
    """
    n = len(payload)
    if n != CHECKPOINT_BODY.size and n != CHECKPOINT_BODY.size + CHECKPOINT_FLAGS.size:
        raise ProtocolError("truncated", "CHECKPOINT")
    step, when, seconds = CHECKPOINT_BODY.unpack_from(payload, 0)
    flags = 0
    if n > CHECKPOINT_BODY.size:
        flags = CHECKPOINT_FLAGS.unpack_from(payload, CHECKPOINT_BODY.size)[0]
    if not math.isfinite(when) or seconds < 0 or flags & ~CHECKPOINT_RESTORE:
        raise ProtocolError("malformed", "CHECKPOINT")
    return Checkpoint(int(step), float(when), float(seconds), bool(flags & CHECKPOINT_RESTORE))


def decode_layers(payload: memoryview) -> Layers:
    """Decode a LAYERS payload to ``(header, stat codes, layer ids, values)``.

    Raises:
        ProtocolError: ``truncated`` when the sizes do not add up.
    """
    if len(payload) < LAYERS_HEADER.size:
        raise ProtocolError("truncated", "LAYERS")
    step, when, checks, seconds, n, k = LAYERS_HEADER.unpack_from(payload, 0)
    if len(payload) != LAYERS_HEADER.size + k + 2 * n + 8 * n * k:
        raise ProtocolError("truncated", "LAYERS")
    off = LAYERS_HEADER.size
    codes = struct.unpack_from(f"<{k}B", payload, off)
    ids = struct.unpack_from(f"<{n}H", payload, off + k)
    values = struct.unpack_from(f"<{n * k}d", payload, off + k + 2 * n)
    header = LayersHeader(int(step), float(when), int(checks), float(seconds))
    return Layers(header, codes, ids, values)


def decode_finish(payload: memoryview) -> Finish:
    """Decode a FINISH payload to ``(status, time)``.

    Raises:
        ProtocolError: ``truncated`` or ``malformed`` (unknown status).
    """
    if len(payload) != FINISH_BODY.size:
        raise ProtocolError("truncated", "FINISH")
    status, when = FINISH_BODY.unpack_from(payload, 0)
    if status not in (FINISH_OK, FINISH_FAILED) or not math.isfinite(when):
        raise ProtocolError("malformed", "FINISH")
    return Finish(int(status), float(when))


def decode_capture(payload: memoryview) -> Capture:
    """Decode a CAPTURE payload to ``(request_id, JSON object, size)``.

    Raises:
        ProtocolError: ``truncated`` (shorter than its request id) or ``malformed`` (not a
            UTF-8 JSON object).
    """
    if len(payload) < CAPTURE_ID.size:
        raise ProtocolError("truncated", "CAPTURE")
    (request_id,) = CAPTURE_ID.unpack_from(payload, 0)
    try:
        obj = json.loads(bytes(payload[CAPTURE_ID.size :]).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError("malformed", f"CAPTURE is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("malformed", "CAPTURE is not a JSON object")
    return Capture(int(request_id), obj, len(payload) - CAPTURE_ID.size)


def _decode_hello_record(payload: memoryview) -> Hello:
    return Hello(decode_hello(payload))


_DECODERS: Final[dict[int, Any]] = {
    HELLO: _decode_hello_record,
    NAME: decode_name,
    STEP: decode_step,
    FINISH: decode_finish,
    EVAL: decode_eval,
    TRACK: decode_track,
    CHECKPOINT: decode_checkpoint,
    LAYERS: decode_layers,
    TOTALS: decode_totals,
    CAPTURE: decode_capture,
}


def decode_record(rtype: int, payload: memoryview) -> Record:
    """Decode one record of type ``rtype`` (from :func:`iter_records`) to its typed form.

    Raises:
        ProtocolError: ``unknown_type`` for a type this version does not define; otherwise
            whatever that type's decoder raises (``truncated``, ``malformed``).
    """
    decoder = _DECODERS.get(rtype)
    if decoder is None:
        raise ProtocolError("unknown_type", str(rtype))
    record: Record = decoder(payload)
    return record
