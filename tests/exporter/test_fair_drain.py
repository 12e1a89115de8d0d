"""Fair draining: a connection that never runs dry cannot keep the others from being read.

The server is the real :class:`~trainmon_exporter.ingest.IngestServer` on a real socket, driven
by hand on an event loop. The flooders are made "faster than the exporter" exactly: each packet
the server applies from one of them is replaced at once by another, so their sockets are never
empty, whatever the speed of the machine.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from trainmon_client import _protocol as P
from trainmon_exporter.ingest import (
    _MIN_TURN_BYTES,
    _TURN_BYTES,
    _TURN_PACKETS,
    Connection,
    IngestMetrics,
    IngestServer,
    turn_bytes,
)

from ..conftest import short_tmpdir
from ..helpers.exporter import hello, pkt, step, store_of

FLOOD_PACKETS = 3000
"""Packets the flooders send in all before they stop (the drain ends only then)."""


def trainer(path: Path, run: str, packets: list[bytes]) -> socket.socket:
    """A raw trainer connection to the socket at ``path``: its HELLO for ``run``, then
    ``packets``, each sent as it is."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(str(path))
    s.send(pkt(hello(run=run)))
    for p in packets:
        s.send(p)
    return s


class Recording(IngestServer):
    """The server, recording which run each applied packet belonged to, and refilling the
    flooders' sockets as it reads them."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.order: list[str] = []
        self.refill: dict[str, socket.socket] = {}
        self.on_first_flood: list[socket.socket] = []

    def handle_packet(self, conn: Connection, data: bytes, deadline: float = math.inf) -> bool:
        done = super().handle_packet(conn, data, deadline)
        run = conn.state.run if conn.state is not None else "?"
        self.order.append(run)
        if run.startswith("flood"):
            if self.order.count(run) > _TURN_PACKETS:
                # The healthy trainer sends in the flooder's second turn, after its own first
                # turn found its socket empty.
                while self.on_first_flood:
                    self.on_first_flood.pop().send(pkt(step(1)))
            if self.order.count(run) < FLOOD_PACKETS:
                self.refill[run].send(pkt(step(2), step(3)))
        return done


async def _drain_with_flooders(n_flooders: int) -> list[str]:
    d = short_tmpdir()
    try:
        server = Recording(
            d / "t.sock",
            store_of(max_ranks=16),
            IngestMetrics(CollectorRegistry()),
            poll_interval=5.0,  # the test drains by hand
            max_bytes_per_second=1e12,  # no token bucket: only the rounds are fair
        )
        server.start()
        socks = []
        for i in range(n_flooders):
            s = trainer(server.path, f"flood{i}", [pkt(step(2), step(3))] * 8)
            server.refill[f"flood{i}"] = s
            socks.append(s)
        healthy = trainer(server.path, "healthy", [])
        socks.append(healthy)
        await asyncio.sleep(0.2)  # accepts (each reads its HELLO, the flooders a first turn)
        server.order.clear()
        server.on_first_flood.append(healthy)
        await asyncio.wait_for(server._drain_all(), timeout=60)
        server.close()
        for s in socks:
            s.close()
        return server.order
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_never_empty_connection_does_not_hold_a_quiet_one_past_one_round() -> None:
    order = asyncio.run(_drain_with_flooders(1))
    assert order.count("flood0") >= FLOOD_PACKETS - 1  # it did flood to the end
    # The healthy step arrived in the second round, after its own empty turn: read at its next
    # turn (two flooder turns in all), not when the flood ended.
    assert "healthy" in order
    assert order.index("healthy") <= 3 * _TURN_PACKETS, order[:100]


def test_many_flooding_connections_of_one_uid_still_leave_every_connection_a_turn() -> None:
    order = asyncio.run(_drain_with_flooders(6))
    assert all(order.count(f"flood{i}") >= FLOOD_PACKETS - 1 for i in range(6))
    assert "healthy" in order
    # Read in the second round: about two turns of each flooder before it.
    assert order.index("healthy") <= 3 * 6 * _TURN_PACKETS, order[:200]


def test_the_connections_of_one_uid_share_a_turns_bytes() -> None:
    assert turn_bytes(1) == _TURN_BYTES
    assert turn_bytes(4) == _TURN_BYTES // 4
    assert turn_bytes(10_000) == _MIN_TURN_BYTES
    assert turn_bytes(0) == _TURN_BYTES


async def _accept_burst(n: int) -> tuple[int, int]:
    """``n`` connections that each queued a HELLO and 10 packets of steps before the server
    accepted them; one call of the accept handler. Returns (accepted, packets read)."""
    d = short_tmpdir()
    try:
        server = Recording(
            d / "t.sock",
            store_of(max_ranks=64),
            IngestMetrics(CollectorRegistry()),
            poll_interval=5.0,
        )
        server.start()
        socks = []
        for i in range(n):
            s = trainer(server.path, f"queued{i}", [pkt(*[step(k)] * 100) for k in range(10)])
            socks.append(s)
        # What the event loop calls while the listening socket is readable: one call accepts
        # until its 5 ms turn is up, so a loaded machine needs more than one.
        for _ in range(n):
            server._accept()
            if len(server._conns) >= n:
                break
        accepted = len(server._conns)
        read = len(server.order)
        server.close()
        for s in socks:
            s.close()
        return accepted, read
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_accepting_reads_one_packet_per_connection_and_leaves_the_rest_to_the_rounds() -> None:
    accepted, read = asyncio.run(_accept_burst(20))
    assert accepted == 20
    assert read == accepted  # each HELLO; their 200 packets of steps wait for the drain


class Slow(IngestServer):
    """The server with every record's application slowed to ``record_s`` seconds, recording
    the event loop's passes (:attr:`ticks`, advanced by :meth:`ticker`) seen at each record,
    so a record that delays the loop is one applied with no pass since the previous one."""

    def __init__(self, *args: object, record_s: float, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.ticks = 0
        self.seen: list[tuple[int, int]] = []  # (step, ticks) of each STEP applied, in order
        apply_record = self.applier._record

        def record(link: Any, rtype: int, payload: memoryview) -> Any:
            out = apply_record(link, rtype, payload)
            if rtype == P.STEP:
                end = time.perf_counter() + record_s
                while time.perf_counter() < end:
                    pass
                assert link.state is not None
                self.seen.append((link.state.step, self.ticks))
            return out

        self.applier._record = record  # type: ignore[method-assign]

    async def ticker(self, until: Callable[[], bool]) -> None:
        while not until():
            self.ticks += 1
            await asyncio.sleep(0)


async def _one_big_packet(poll_interval: float) -> Slow:
    d = short_tmpdir()
    try:
        server = Slow(
            d / "t.sock",
            store_of(max_ranks=4),
            IngestMetrics(CollectorRegistry()),
            poll_interval=poll_interval,
            record_s=0.001,  # 500 steps: 0.5 s of work in one packet, 100 slices
        )
        server.start()
        s = trainer(server.path, "big", [pkt(*(step(k) for k in range(1, 501)))])
        await asyncio.wait_for(server.ticker(lambda: len(server.seen) >= 500), timeout=60)
        server.close()
        s.close()
        return server
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("poll_interval", [0.01, 0.0])
def test_a_packet_longer_than_a_slice_is_applied_in_order_over_several_turns(
    poll_interval: float,
) -> None:
    """The event loop runs between slices even inside one packet (here 0.5 s of records):
    no run of records without a pass of the loop lasts much more than a slice."""
    server = asyncio.run(_one_big_packet(poll_interval))
    steps = [st for st, _ in server.seen]
    assert steps == list(range(1, 501))  # every record once, in order
    longest = run = 0
    for (_, before), (_, after) in itertools.pairwise(server.seen):
        run = run + 1 if after == before else 0
        longest = max(longest, run)
    # 5 ms slices of 1 ms records: about 5 records in a row, never the whole packet. Slack for
    # a loaded machine, where one record can take several milliseconds of wall time.
    assert longest < 50, longest
    m = server.metrics
    assert m.packets._value.get() == 2  # the HELLO's packet and the big one, each counted once
