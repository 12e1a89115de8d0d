"""Hypothesis strategies for the wire protocol and a target that applies packets to a real
exporter's ingest, state and collectors (no socket I/O: a ``socketpair`` stands in for the
trainer's connection). Shared by ``tests/exporter/test_fuzz.py`` (bounded, in the suite) and
``benchmarks/fuzz.py`` (many more examples, on demand).
"""

from __future__ import annotations

import itertools
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from prometheus_client import generate_latest

from trainmon_client import _protocol as P
from trainmon_exporter.analytics import AnalyticsSettings, RankAnalytics
from trainmon_exporter.app import build_exporter
from trainmon_exporter.ingest import Connection
from trainmon_exporter.settings import Settings
from trainmon_exporter.state.rank import RankState

EXTREMES = [
    0.0,
    -0.0,
    1e-300,
    -1e-300,
    5e-324,
    1e300,
    -1e300,
    1e308,
    -1e308,
    1.7976931348623157e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    1.0,
    2.5,
]
floats = st.one_of(
    st.sampled_from(EXTREMES),
    st.sampled_from(EXTREMES),
    st.floats(allow_nan=True, allow_infinity=True),
)
layer_values = st.one_of(
    st.sampled_from([1e-300, 1e300, 5e-324, 1e308, 1.0, 0.0, float("nan"), float("inf")]),
    floats,
)
u64 = st.one_of(st.sampled_from([0, 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
u16 = st.integers(0, 0xFFFF)
field_ids = st.one_of(
    st.integers(1, 12),
    st.integers(P.FIRST_CUSTOM_ID, P.FIRST_CUSTOM_ID + 8),
    st.integers(P.FIRST_CUSTOM_ID, P.FIRST_CUSTOM_ID + 8),
    u16,
)
names = st.one_of(
    st.sampled_from(["m", "layer.0", "0", "x" * 128, "x" * 129, 'q"x', "a b", "é", ""]),
    st.text(max_size=40),
)


def _record(rtype: int, body: bytes) -> bytes:
    return P.RECORD_HEADER.pack(rtype, len(body)) + body


@st.composite
def step_records(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(0, 6))
    head = P.STEP_HEADER.pack(
        draw(u64), draw(u64), draw(floats), draw(floats), draw(floats), draw(floats),
        draw(floats), draw(u64), draw(u64), draw(u64),
    )  # fmt: skip
    ids = [draw(field_ids) for _ in range(n)]
    return P.encode_fields(P.STEP, head, ids, [draw(floats) for _ in range(n)])


@st.composite
def layers_records(draw: st.DrawFn) -> bytes:
    n = draw(st.integers(0, 5))
    n = max(n, draw(st.integers(0, 5)))  # mostly several layers: gains need pairs
    codes = draw(st.lists(st.one_of(st.sampled_from([1, 4, 5]), st.integers(0, 255)), max_size=6))
    if draw(st.booleans()):
        codes = [1, *codes]  # gradient norms: the layer-to-layer gain
    ids = [draw(field_ids) for _ in range(n)]
    values = [draw(layer_values) for _ in range(n * len(codes))]
    return P.encode_layers(draw(u64), draw(floats), draw(u64), draw(floats), ids, codes, values)


@st.composite
def other_records(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return _record(P.NAME, P.NAME_ID.pack(draw(field_ids)) + draw(names).encode())
    if kind == 1:
        n = draw(st.integers(0, 4))
        head = P.EVAL_HEADER.pack(draw(u64), draw(floats))
        return P.encode_fields(P.EVAL, head, [draw(field_ids) for _ in range(n)],
                               [draw(floats) for _ in range(n)])  # fmt: skip
    if kind == 2:
        body = P.TRACK_BODY.pack(
            draw(field_ids), draw(st.integers(0, 255)), draw(floats), draw(u64)
        )
        return _record(P.TRACK, body)
    if kind == 3:
        return _record(P.CHECKPOINT, P.CHECKPOINT_BODY.pack(draw(u64), draw(floats), draw(floats)))
    if kind == 4:
        return _record(P.FINISH, P.FINISH_BODY.pack(draw(st.integers(0, 255)), draw(floats)))
    if kind == 5:
        return _record(P.TOTALS, P.TOTALS_BODY.pack(*(draw(u64) for _ in range(7))))
    # Anything: a type byte and random payload (the length may lie).
    body = draw(st.binary(max_size=64))
    return struct.pack("<BH", draw(st.integers(0, 255)), draw(st.integers(0, 0xFFFF))) + body


def hello_record(run: str, overrides: dict[str, Any] | None = None) -> bytes:
    fields: dict[str, Any] = {
        "run": run, "rank": 0, "local_rank": 0, "world_size": 1, "hostname": "fuzz",
        "pid": 1, "client_version": "fuzz", "gpu_uuid": None, "started_at": 1.0,
        "flops_per_token": 6e9, "dtype": "bf16",
    }  # fmt: skip
    fields.update(overrides or {})
    return P.encode_hello(fields)


json_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20), st.lists(st.integers(), max_size=3),
)  # fmt: skip
hello_overrides = st.dictionaries(
    st.sampled_from([*P.HELLO_FIELDS, "extra"]), json_values, max_size=3
)
records = st.one_of(step_records(), step_records(), layers_records(), other_records())


@st.composite
def packets(draw: st.DrawFn, run: str) -> list[bytes]:
    """A connection's packets: a HELLO (sometimes odd), then records, sometimes mangled."""
    odd = draw(st.one_of(st.just({}), st.just({}), st.just({}), hello_overrides))
    # Names bound up front, so records' custom ids and layer ids mostly refer to something.
    bound = b"".join(P.encode_name(P.FIRST_CUSTOM_ID + i, f"n{i}") for i in range(9))
    out = [P.packet_header() + hello_record(run, odd) + bound]
    for _ in range(draw(st.integers(1, 4))):
        body = b"".join(draw(st.lists(records, min_size=0, max_size=6)))
        pkt = P.packet_header() + body
        mangle = draw(st.integers(0, 9))
        if mangle == 0 and pkt:
            i = draw(st.integers(0, len(pkt) - 1))
            pkt = pkt[:i] + bytes([draw(st.integers(0, 255))]) + pkt[i + 1 :]
        elif mangle == 1:
            pkt = pkt[: draw(st.integers(0, len(pkt)))]
        elif mangle == 2:
            pkt = b""
        out.append(pkt[: P.MAX_PACKET_BYTES + 1])
    return out


raw_packets = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda b: P.packet_header() + b, st.binary(max_size=256)),
    st.builds(lambda rs: P.packet_header() + b"".join(rs), st.lists(records, max_size=8)),
)


def decode_all(packet: bytes) -> int:
    """Split and decode every record of ``packet``; only ``ProtocolError`` may come out.

    Returns the records decoded.
    """
    decoders = {
        P.HELLO: P.decode_hello, P.NAME: P.decode_name, P.STEP: P.decode_step,
        P.FINISH: P.decode_finish, P.EVAL: P.decode_eval, P.TRACK: P.decode_track,
        P.CHECKPOINT: P.decode_checkpoint, P.LAYERS: P.decode_layers, P.TOTALS: P.decode_totals,
    }  # fmt: skip
    n = 0
    try:
        for rtype, payload in P.iter_records(packet):
            decoder = decoders.get(rtype)
            if decoder is None:
                continue
            try:
                decoder(payload)
                n += 1
            except P.ProtocolError:
                pass
    except P.ProtocolError:
        pass
    return n


class Target:
    """A real exporter (store, ingest, every training collector) without its event loop."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tm-fuzz-", dir="/tmp"))
        settings = Settings(
            socket=self.dir / "t.sock",
            max_ranks=64,
            collectors={"gpu": False, "rank_gpu": False, "process": False},
        )
        self.exporter = build_exporter(settings)
        self.ingest = self.exporter.ingest
        self.runs = itertools.count()
        self.packets = 0

    def apply(self, pkts: list[bytes]) -> None:
        """Feed one connection's packets, close it, and scrape. Raises on any failure."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn = Connection(a)
        self.ingest._conns[conn.fd] = conn
        self.ingest.metrics.connections.inc()
        try:
            for pkt in pkts:
                self.ingest.handle_packet(conn, pkt)
                self.packets += 1
        finally:
            self.ingest._close(conn, record=True)
            b.close()
        generate_latest(self.exporter.registry)
        self.exporter.store.expire(now_mono=float("inf"))  # every disconnected rank goes

    def internal_errors(self) -> float:
        return self.ingest.metrics.invalid_total.labels("internal_error")._value.get()  # type: ignore[no-any-return]

    def next_run(self) -> str:
        return f"fuzz-{next(self.runs):09d}"  # one length: the same draws give the same bytes


layer_rows = st.lists(
    st.dictionaries(st.sampled_from([1, 2, 4, 5, 16, 22]), layer_values, max_size=4),
    max_size=8,
)
step_heads = st.tuples(u64, u64, floats, floats, floats, floats, floats, u64, u64, u64)
step_fields = st.lists(st.tuples(st.integers(1, 11), floats), max_size=6)


step_heads_and_fields = st.tuples(step_heads, step_fields)


def new_state() -> RankState:
    return RankState(
        run="r", rank=0, local_rank=0, world_size=1, hostname="h", pid=1,
        client_version="t", gpu_uuid=None, started_at=1.0, flops_per_token=6e9, dtype="bf16",
        buckets=(0.1, 1.0, 10.0), analytics=RankAnalytics(AnalyticsSettings()),
    )  # fmt: skip
