"""The transport on its own against real Unix sockets: connect and backoff, what became of each
packet, and what a peer that went away had not read."""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainmon_client import _protocol as P
from trainmon_client._transport import (
    BACKOFF_MIN_S,
    Outcome,
    Transport,
    expected_exporter_uid,
)

from ..helpers.client import Listener

HELLO = [P.packet_header() + P.encode_hello({"run": "t"})]
PACKET = P.packet_header() + P.encode_checkpoint(1, 0.0, 0.0)


def test_no_listener_then_one_after_the_backoff(sockdir: Path) -> None:
    path = sockdir / "t.sock"
    t = Transport(str(path))
    assert not t.connect(0.0, lambda: HELLO) and not t.connected
    assert t.send(PACKET, 1, 0.0).outcome is Outcome.DISCONNECTED
    listener = Listener(path)
    try:
        assert not t.connect(BACKOFF_MIN_S / 2, lambda: HELLO)  # still backing off
        assert t.connect(BACKOFF_MIN_S, lambda: HELLO) and t.connected
        conn = listener.accept()
        conn.settimeout(5)
        assert conn.recv(P.MAX_PACKET_BYTES) == HELLO[0]
        result = t.send(PACKET, 1, 1.0)
        assert result.outcome is Outcome.SENT and not result.resend_names
        assert t.sent_connection == 1
        assert conn.recv(P.MAX_PACKET_BYTES) == PACKET
        assert t.check(1.0) == 0
        t.start_deadline()
        assert t.await_read() == 0  # read: nothing in flight
    finally:
        t.close()
        listener.close()


def test_a_full_buffer_is_backpressure_and_never_blocks(listener: Listener) -> None:
    t = Transport(str(listener.path))
    assert t.connect(0.0, lambda: HELLO)
    listener.accept()  # never read
    big = PACKET + bytes(8000)
    t0 = time.perf_counter()
    results = [t.send(big, 1, 0.0) for _ in range(500)]
    assert time.perf_counter() - t0 < 1.0
    outcomes = {r.outcome for r in results}
    assert outcomes == {Outcome.SENT, Outcome.BACKPRESSURE}
    assert all(r.resend_names for r in results if r.outcome is Outcome.BACKPRESSURE)
    assert t.connected  # the connection stays
    t.close()


def test_a_peer_that_hangs_up_unread_returns_what_was_in_flight(listener: Listener) -> None:
    t = Transport(str(listener.path))
    assert t.connect(0.0, lambda: HELLO)
    conn = listener.accept()
    for _ in range(3):
        assert t.send(PACKET, 2, 0.0).outcome is Outcome.SENT
    conn.close()  # the three packets go unread
    assert t.check(5.0) == 6
    assert not t.connected
    assert not t.connect(5.0 + BACKOFF_MIN_S / 2, lambda: HELLO)  # backs off from then


def test_a_listener_of_another_uid_is_refused(listener: Listener) -> None:
    t = Transport(str(listener.path), exporter_uid=os.getuid() + 1)
    assert not t.connect(0.0, lambda: HELLO)
    same = Transport(str(listener.path), exporter_uid=os.getuid())
    assert same.connect(0.0, lambda: HELLO)
    same.close()


def test_expected_exporter_uid() -> None:
    assert expected_exporter_uid({}) is None
    assert expected_exporter_uid({"TRAINMON_EXPORTER_UID": " 0 "}) == 0
    issues: list[str] = []  # not a uid: fails closed (no listener has uid -1), never raises
    assert expected_exporter_uid({"TRAINMON_EXPORTER_UID": "root"}, issues) == -1
    assert issues == ["TRAINMON_EXPORTER_UID"]
