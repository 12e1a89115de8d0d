"""The encoder on its own: steps and records in, packet bytes out, with no socket and no clock."""

from __future__ import annotations

import math
import struct
from collections import deque
from typing import Any

import pytest

from trainmon_client import _protocol as P
from trainmon_client._encoder import FLUSH_BYTES, Encoder, as_step

HEADER = P.packet_header()


def queue(*steps: tuple[Any, float, dict[str, Any]]) -> deque[tuple[Any, float, dict[str, Any]]]:
    return deque(steps)


def records(packet: bytes) -> list[tuple[int, Any]]:
    return [(t, P.decode_record(t, p)) for t, p in P.iter_records(packet)]


def encode(enc: Encoder, *steps: tuple[Any, float, dict[str, Any]], **kw: Any) -> bytes:
    """Encode ``steps`` with zero totals and a wall clock 1000 s ahead; one packet out."""
    args = {"to_wall": 1000.0, "overhead": 0.0, "disconnected": 0, "backpressure": 0}
    args.update(kw)
    enc.add_steps(
        queue(*steps),
        (),
        args["to_wall"],
        args["overhead"],
        args["disconnected"],
        args["backpressure"],
        0,
    )
    [(packet, _)] = enc.take_packets()
    return packet


def test_a_step_is_the_documented_bytes() -> None:
    enc = Encoder(lambda: False)
    pending = queue((7, 100.0, {"loss": 2.5, "lr": 0.125, "tokens": 64, "samples": 2}))
    assert enc.add_steps(pending, (), 1000.0, 0.5, 1, 2, 3) == (0, 0)
    assert not pending
    [(packet, n)] = enc.take_packets()
    assert n == 1
    head = P.STEP_HEADER.pack(7, 1, 1100.0, math.nan, 64.0, 2.0, 0.5, 1, 2, 3)
    fields = struct.pack("<2H2d", P.FIELD_LOSS, P.FIELD_LR, 2.5, 0.125)
    assert packet == HEADER + P.RECORD_HEADER.pack(P.STEP, len(head) + 20) + head + fields


def test_totals_are_cumulative_and_bad_increments_are_refused() -> None:
    enc = Encoder(lambda: False)
    pending = queue(
        (1, 10.0, {"loss": 1.0, "batch_size": 4, "seq_len": 8}),  # 32 tokens, 4 samples
        (2, 10.5, {"loss": 1.0, "tokens": math.nan, "samples": -1}),  # both refused
        (3, 11.5, {"loss": 1.0, "tokens": 10, "samples": 1}),
    )
    assert enc.add_steps(pending, (), 0.0, 0.0, 0, 0, 5) == (2, 0)
    [(packet, n)] = enc.take_packets()
    steps = [r for t, r in records(packet) if t == P.STEP]
    assert n == 3
    assert [s.header.tokens_total for s in steps] == [32.0, 32.0, 42.0]
    assert [s.header.samples_total for s in steps] == [4.0, 4.0, 5.0]
    assert [s.header.refused_values_total for s in steps] == [5, 7, 7]
    assert [s.header.steps_total for s in steps] == [1, 2, 3]
    assert math.isnan(steps[0].header.step_time)
    assert [s.header.step_time for s in steps[1:]] == [0.5, 1.0]
    assert (enc.steps, enc.tokens, enc.samples) == (3, 42.0, 5.0)
    # batch_size and seq_len are fields as well as the source of the totals
    assert steps[0].ids == (P.FIELD_LOSS, P.FIELD_BATCH_SIZE, P.FIELD_SEQ_LEN)


def test_names_are_interned_once_and_announced_only_on_a_connection() -> None:
    up = [False]
    enc = Encoder(lambda: up[0])
    packet = encode(enc, (1, 0.0, {"my_metric": 1.0}))
    assert [t for t, _ in records(packet)] == [P.STEP]  # no connection: the HELLO will carry it
    up[0] = True
    packet = encode(enc, (2, 0.0, {"my_metric": 2.0, "other": 3.0}))
    assert records(packet)[:1] == [(P.NAME, P.Name(65, "other"))]
    assert enc.names == {"my_metric": 64, "other": 65}
    [hello] = enc.hello_packets({"run": "r"})
    assert records(hello) == [
        (P.HELLO, P.Hello({"run": "r"})),
        (P.NAME, P.Name(64, "my_metric")),
        (P.NAME, P.Name(65, "other")),
    ]
    enc.add_names()  # a dropped packet may have carried them: announced again
    assert [r for _, r in records(enc.take_packets()[0][0])] == [
        P.Name(64, "my_metric"),
        P.Name(65, "other"),
    ]


def test_names_past_the_cap_and_bad_names_are_refused_at_every_step() -> None:
    enc = Encoder(lambda: False, max_custom_names=2)
    steps = [(i, 0.0, {"a": 1.0, "b": 2.0, "c": 3.0, "bad name": 4.0}) for i in range(3)]
    assert enc.add_steps(queue(*steps), (), 0.0, 0.0, 0, 0, 0) == (6, 0)
    assert enc.names == {"a": 64, "b": 65}
    [(packet, _)] = enc.take_packets()
    decoded = [r for t, r in records(packet) if t == P.STEP]
    assert all(s.ids == (64, 65) and s.values == (1.0, 2.0) for s in decoded)
    assert [s.header.refused_values_total for s in decoded] == [2, 4, 6]
    # layer names have their own allowance
    ids, values, refused = enc.layer_ids(["0", "bad name", "2"], [1, 5], [1, 2, 3, 4, 5, 6])
    assert (ids, values, refused) == ([66, 67], [1, 2, 5, 6], 1)


def test_steps_held_for_device_copies_stay_queued_in_order() -> None:
    enc = Encoder(lambda: False)
    waiting: dict[str, Any] = {"loss": 0.0}
    pending = queue((1, 0.0, {"loss": 1.0}), (2, 0.0, waiting), (3, 0.0, {"loss": 3.0}))
    enc.add_steps(pending, {id(waiting): 1}, 0.0, 0.0, 0, 0, 0)
    assert [s for s, _, _ in pending] == [2, 3]
    assert enc.steps == 1


def test_a_step_that_cannot_be_encoded_is_skipped_alone() -> None:
    enc = Encoder(lambda: False)
    pending = queue(
        (1, 0.0, {"loss": 10**400}),  # no f64 holds it
        ("x", 0.0, {"loss": 1.0}),  # not a step
        (2, 0.0, {"loss": 1.0, "tokens": 10**400}),
        (3, 0.0, {"loss": 1.0}),
    )
    assert enc.add_steps(pending, (), 0.0, 0.0, 0, 0, 0) == (1, 2)
    [(packet, n)] = enc.take_packets()
    [step] = [r for t, r in records(packet) if t == P.STEP]
    assert n == 1 and (step.header.step, step.header.steps_total) == (3, 1)
    assert step.header.tokens_total == 0.0


def test_packets_close_before_flush_bytes() -> None:
    enc = Encoder(lambda: False)
    fields = {f"m{i}": float(i) for i in range(40)}
    n = 500
    enc.add_steps(queue(*[(i, 0.0, fields) for i in range(n)]), (), 0.0, 0.0, 0, 0, 0)
    packets = enc.take_packets()
    assert len(packets) > 1
    assert all(len(p) <= FLUSH_BYTES and p.startswith(HEADER) for p, _ in packets)
    assert sum(k for _, k in packets) == n
    assert enc.take_packets() == []  # nothing left open


def test_rare_records() -> None:
    enc = Encoder(lambda: True)
    record, refused = enc.eval_record(6, 123.0, {"val_loss": 2.5, "accuracy": 0.25, "no good": 1})
    assert refused == 1 and record is not None
    enc.add(record, data=True)
    assert enc.eval_record(-1, 123.0, {"val_loss": 2.5}) == (None, 1)
    fid = enc.intern("validation")
    enc.add(enc.track_started(fid), data=True)
    enc.add(enc.track_stopped(fid, 1.5), data=True)
    enc.add(enc.track_started(fid), data=True)
    [(packet, n)] = enc.take_packets()
    assert n == 4
    decoded = [r for _, r in records(packet)]
    assert decoded == [
        P.Name(64, "accuracy"),
        P.Eval(6, 123.0, (P.FIELD_VAL_LOSS, 64), (2.5, 0.25)),
        P.Name(65, "validation"),
        P.Track(65, True, 0.0, 0),
        P.Track(65, False, 1.5, 1),
        P.Track(65, True, 1.5, 1),
    ]


@pytest.mark.parametrize(
    ("step", "expected"),
    [(5, 5), (2.0, 2), (P.MAX_STEP, P.MAX_STEP), (-1, None), (2.5, None), ("5", None)],
)
def test_as_step(step: Any, expected: int | None) -> None:
    assert as_step(step) == expected
    assert as_step(True) is None and as_step(P.MAX_STEP + 1) is None
