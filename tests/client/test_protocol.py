"""The wire protocol: encoding round trips and every way a packet can be wrong."""

from __future__ import annotations

import math
import struct

import pytest

from trainmon_client import _names as N
from trainmon_client import _protocol as P


def packet(*records: bytes) -> bytes:
    return P.packet_header() + b"".join(records)


def step_record(step: int, ids: tuple[int, ...], values: tuple[float, ...]) -> bytes:
    s = P.step_struct(len(ids))
    head = (step, 7, 1700000000.5, 0.25, 4096.0, 8.0, 0.001, 1, 2, 3)
    return s.pack(P.STEP, P.step_payload_length(len(ids)), *head, *ids, *values)


def test_step_record_round_trip_keeps_every_field() -> None:
    rec = step_record(42, (1, 2, 64), (2.5, 3e-4, math.inf))
    [(rtype, payload)] = list(P.iter_records(packet(rec)))
    assert rtype == P.STEP
    head, ids, values = P.decode_step(payload)
    assert head == (42, 7, 1700000000.5, 0.25, 4096.0, 8.0, 0.001, 1, 2, 3)
    assert ids == (1, 2, 64)
    assert values[:2] == (2.5, 3e-4) and values[2] == math.inf


def test_step_record_size_is_header_plus_ten_bytes_per_field() -> None:
    assert P.STEP_HEADER.size == 80
    assert len(step_record(1, (1,) * 10, (0.0,) * 10)) == P.RECORD_HEADER.size + 80 + 100


def test_nan_survives_the_wire() -> None:
    rec = step_record(1, (1,), (math.nan,))
    [(_, payload)] = list(P.iter_records(packet(rec)))
    assert math.isnan(P.decode_step(payload)[2][0])


def test_hello_name_finish_round_trip() -> None:
    hello = {k: None for k in P.HELLO_FIELDS} | {"run": "r", "rank": 3}
    data = packet(
        P.encode_hello(hello),
        P.encode_name(64, "opt/adam_eps"),
        P.encode_finish(P.FINISH_FAILED, 12.5),
    )
    records = list(P.iter_records(data))
    assert [t for t, _ in records] == [P.HELLO, P.NAME, P.FINISH]
    assert P.decode_hello(records[0][1]) == hello
    assert P.decode_name(records[1][1]) == (64, "opt/adam_eps")
    assert P.decode_finish(records[2][1]) == (P.FINISH_FAILED, 12.5)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"T", "truncated"),
        (b"XX\x01\x00", "bad_magic"),
        (b"TM\x09\x00", "unknown_version"),
        (P.packet_header() + b"\x03", "truncated"),
        (P.packet_header() + struct.pack("<BH", 3, 500) + b"\x00" * 10, "truncated"),
        (P.packet_header() + b"\x00" * P.MAX_PACKET_BYTES, "oversized"),
    ],
)
def test_bad_packets_raise_protocol_error_with_reason(data: bytes, reason: str) -> None:
    with pytest.raises(P.ProtocolError) as info:
        list(P.iter_records(data))
    assert info.value.reason == reason


def test_records_before_a_truncated_one_are_still_yielded() -> None:
    good = step_record(1, (1,), (1.0,))
    data = packet(good) + struct.pack("<BH", P.STEP, 999)
    it = P.iter_records(data)
    assert next(it)[0] == P.STEP
    with pytest.raises(P.ProtocolError, match="truncated"):
        next(it)


@pytest.mark.parametrize(
    ("decoder", "payload", "reason"),
    [
        (P.decode_step, b"\x00" * 79, "truncated"),
        (P.decode_step, b"\x00" * 85, "truncated"),  # not a whole number of fields
        (P.decode_hello, b"{not json", "malformed"),
        (P.decode_hello, b"[1, 2]", "malformed"),
        (P.decode_hello, b"\xff\xfe", "malformed"),
        (P.decode_name, b"\x40", "truncated"),
        (P.decode_name, struct.pack("<H", 3) + b"loss", "malformed"),  # reserved id
        (P.decode_name, struct.pack("<H", 64) + b"\xff", "malformed"),
        (P.decode_finish, b"\x00", "truncated"),
        (P.decode_finish, struct.pack("<Bd", 7, 1.0), "malformed"),
    ],
)
def test_bad_payloads(decoder, payload: bytes, reason: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(P.ProtocolError) as info:
        decoder(memoryview(payload))
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("loss_scale", True),
        ("train/acc@1".replace("@", "_"), True),
        ("optimizer.adam:eps-max", True),
        ("_x", True),
        ("a" * 128, True),
        ("a" * 129, False),
        ("", False),
        ("1abc", False),
        ('bad"quote', False),
        ("new\nline", False),
        ("sp ace", False),
        (None, False),
    ],
)
def test_metric_name_rules(name: object, ok: bool) -> None:
    assert N.valid_metric_name(name) is ok


@pytest.mark.parametrize(
    ("run", "ok"),
    [
        ("gpt2-124m", True),
        ("slurm-12345", True),
        ("3f1c2e9a-0b1d-4c3e-8f00-123456789abc", True),
        ("exp:lr=3e-4".replace("=", "_"), True),
        ('run"x', False),
        ("run\nx", False),
        ("r" * 10_000, False),
        ("", False),
    ],
)
def test_run_id_rules(run: str, ok: bool) -> None:
    assert N.valid_run_id(run) is ok


def test_every_record_type_has_a_name_and_a_typed_decoder() -> None:
    payloads = {
        P.HELLO: P.encode_hello({"run": "r", "rank": 0})[3:],
        P.NAME: P.encode_name(64, "x")[3:],
        P.STEP: P.encode_fields(P.STEP, P.STEP_HEADER.pack(*range(10)), [1], [2.0])[3:],
        P.FINISH: P.encode_finish(P.FINISH_OK, 1.0)[3:],
        P.EVAL: P.encode_fields(P.EVAL, P.EVAL_HEADER.pack(3, 1.0), [6], [2.5])[3:],
        P.TRACK: P.encode_track(64, True, 1.5, 2)[3:],
        P.CHECKPOINT: P.encode_checkpoint(5, 1.0, 2.0)[3:],
        P.LAYERS: P.encode_layers(1, 1.0, 1, 0.5, [64], [P.STAT_GRAD_NORM], [0.1])[3:],
        P.TOTALS: P.encode_totals(P.Totals(1, 2, 3, 4, 5, 6, 7))[3:],
        P.CAPTURE: P.encode_capture(9, b'{"notes":[]}')[3:],
    }
    assert set(payloads) == set(P.RECORD_NAMES)
    kinds = {P.decode_record(t, memoryview(p)).__class__.__name__ for t, p in payloads.items()}
    assert kinds == {
        "Hello",
        "Name",
        "Step",
        "Finish",
        "Eval",
        "Track",
        "Checkpoint",
        "Layers",
        "Totals",
        "Capture",
    }
    track = P.decode_record(P.TRACK, memoryview(payloads[P.TRACK]))
    assert track == P.Track(64, True, 1.5, 2)
    with pytest.raises(P.ProtocolError) as exc:
        P.decode_record(200, memoryview(b""))
    assert exc.value.reason == "unknown_type"


def test_a_protocol_error_carries_one_of_the_listed_reasons() -> None:
    for reason in P.PROTOCOL_ERRORS:
        assert P.ProtocolError(reason, "detail").reason == reason
    with pytest.raises(ValueError):
        P.ProtocolError("not_a_reason")


def test_named_constants_are_the_standard_tables() -> None:
    assert (
        P.STANDARD_FIELDS["loss"] == P.FIELD_LOSS
        and P.STANDARD_NAMES[P.FIELD_VAL_LOSS] == "val_loss"
    )
    assert P.LAYER_STATS["update_ratio"] == P.STAT_UPDATE_RATIO
    assert P.MAX_STEP == 2**64 - 1


def test_a_capture_request_travels_as_a_packet_of_its_own() -> None:
    packet = P.encode_capture_request(7, 32768)
    assert P.decode_capture_requests(packet) == [P.CaptureRequest(7, 32768)]
    assert P.decode_refused(packet) is None  # a client reads either from the same socket
    assert P.decode_capture_requests(P.encode_refused("not_owner")) == []
    assert P.decode_capture_requests(b"junk") == []
    bad_length = P.packet_header() + P.RECORD_HEADER.pack(P.CAPTURE_REQUEST, 3) + b"abc"
    assert P.decode_capture_requests(bad_length) == []


def test_a_capture_round_trips_and_refuses_what_is_not_a_json_object() -> None:
    body = b'{"notes":["x"],"threads":[]}'
    record = P.encode_capture(2**32 - 1, body)
    ((rtype, payload),) = list(P.iter_records(P.packet_header() + record))
    decoded = P.decode_record(rtype, payload)
    assert decoded == P.Capture(2**32 - 1, {"notes": ["x"], "threads": []}, len(body))
    for raw, reason in (
        (b"\x01\x00", "truncated"),
        (P.CAPTURE_ID.pack(1) + b"[1, 2]", "malformed"),
        (P.CAPTURE_ID.pack(1) + b"\xff\xfe", "malformed"),
        (P.CAPTURE_ID.pack(1) + b"[" * 100_000, "malformed"),
    ):
        with pytest.raises(P.ProtocolError) as exc:
            P.decode_capture(memoryview(raw))
        assert exc.value.reason == reason
    with pytest.raises(ValueError, match="too large"):
        P.encode_capture(1, b"x" * (P.MAX_CAPTURE_BYTES + 1))
    largest = P.packet_header() + P.encode_capture(1, b"x" * P.MAX_CAPTURE_BYTES)
    assert len(largest) == P.MAX_PACKET_BYTES
