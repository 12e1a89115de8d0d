"""The client's delivery accounting against real Unix sockets: every record it is given is sent,
dropped with a reason, or refused, and ``finish()`` keeps one deadline whatever the peer does.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainmon_client import Run
from trainmon_client import _protocol as P
from trainmon_client._transport import FINISH_TIMEOUT_S

from ..helpers.client import Listener, make_run, steps_of


def accounted(run: Run) -> int:
    """Records the client has an account of: sent, or dropped before sending for a reason
    (``in_flight`` records were sent: they are part of ``sent``)."""
    return run.sent + sum(v for k, v in run.dropped.items() if k != "in_flight")


@pytest.fixture
def mute(sockdir: Path) -> Iterator[tuple[Path, socket.socket]]:
    """A listening socket that never accepts, so never reads: alive but not reading."""
    path = sockdir / "mute.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(str(path))
    srv.listen(8)
    yield path, srv
    srv.close()


def test_a_string_or_a_bool_is_not_a_step(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    run.log("5", loss=1.0)  # type: ignore[arg-type]
    run.log(True, loss=1.0)  # type: ignore[arg-type]
    run.log(b"5", loss=1.0)  # type: ignore[arg-type]
    run.log(7, loss=1.0)
    np = pytest.importorskip("numpy")
    run.log(np.bool_(True), loss=1.0)
    run.log(np.int64(8), loss=1.0)
    torch = pytest.importorskip("torch")
    run.log(torch.tensor(True), loss=1.0)
    run.log(torch.tensor(9), loss=1.0)
    run.finish()
    listener.accept()
    assert [h.step for h, _, _ in steps_of(listener.records())] == [7, 8, 9]
    assert run.refused == 5
    assert run.sent == 3


def test_a_step_that_cannot_be_encoded_is_counted_and_the_next_one_goes(
    listener: Listener,
) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    run.log(1, loss=1.0, tokens=10)
    run.log(2, loss=10**400, tokens=10)  # an int no f64 holds: struct raises OverflowError
    run.log(3, loss=1.0, tokens=10**400)  # the same in a running total: never poisons it
    run.log(4, loss=0.5, tokens=10)
    run.finish()
    listener.accept()
    recs = listener.records(totals=True)
    steps = steps_of(recs)
    assert [h.step for h, _, _ in steps] == [1, 4]
    assert [h.tokens_total for h, _, _ in steps] == [10.0, 20.0]
    assert run.dropped["encode_error"] == 2
    last = [r[1] for r in recs if r[0] == P.TOTALS][-1]
    assert last.dropped_encode_error == 2 and last.sent_total == 2 == last.sent_connection


def test_nan_or_negative_tokens_are_refused_not_summed(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    run.log(1, loss=1.0, tokens=10, samples=1)
    run.log(2, loss=1.0, tokens=float("nan"), samples=-1)
    run.log(3, loss=1.0, tokens=-5, samples=float("inf"))
    run.log(4, loss=1.0, tokens=10, samples=1)
    run.finish()
    listener.accept()
    steps = steps_of(listener.records())
    assert [h.tokens_total for h, _, _ in steps] == [10.0, 10.0, 10.0, 20.0]
    assert [h.samples_total for h, _, _ in steps] == [1.0, 1.0, 1.0, 2.0]
    assert run.refused == 4  # each bad increment once; the steps themselves are sent
    assert run.sent == 4


def test_every_packet_ends_with_the_totals_of_its_connection(listener: Listener) -> None:
    run = make_run(listener.path, flush_interval=0.0)
    for i in range(5):
        run.log(i, loss=1.0)
    run.eval(4, val_loss=1.0)
    run.checkpoint(4)
    listener.accept()
    pkts: list[bytes] = []
    reader = threading.Thread(target=lambda: pkts.extend(listener.packets(2.0)))
    reader.start()
    run.finish()
    reader.join()
    data = 0
    for pkt in pkts:
        recs = list(P.iter_records(pkt))
        data += sum(1 for t, _ in recs if t in P.DATA_RECORDS)
        if recs[0][0] == P.HELLO:
            continue
        assert recs[-1][0] == P.TOTALS
        totals = P.decode_totals(recs[-1][1])
        assert totals.sent_connection == data == totals.sent_total
    assert data == 7 == run.sent and sum(run.dropped.values()) == 0


def test_finish_keeps_one_deadline_against_a_peer_that_never_reads(
    mute: tuple[Path, socket.socket],
) -> None:
    """Before: 24 to 62 s (1 s per packet). After: one deadline, every record accounted for."""
    path, _srv = mute
    run = make_run(path, flush_interval=60.0)
    fields = {f"metric_{i}": float(i) for i in range(40)}
    run.log(0, loss=1.0, **fields)  # the first step sends at once and connects
    n = 20_000  # ~17 MB of steps: hundreds of packets, far more than the socket buffers hold
    for i in range(1, n):
        run.log(i, loss=1.0, **fields)
    t0 = time.perf_counter()
    run.finish()
    took = time.perf_counter() - t0
    assert took < FINISH_TIMEOUT_S + 4.0  # generous for a loaded machine; before: 24-62 s
    assert accounted(run) == n
    assert run.dropped["backpressure"] > 0
    # What the kernel took but the peer never read is not "delivered".
    assert run.dropped["in_flight"] == run.sent


def test_records_a_peer_discards_unread_count_as_in_flight(
    mute: tuple[Path, socket.socket],
) -> None:
    """Records the kernel accepted and the peer then discarded unread (a refused HELLO, a
    frozen exporter that is killed) are ``in_flight``, not silently "sent"."""
    path, srv = mute
    run = make_run(path, flush_interval=0.0)
    for i in range(40):
        run.log(i, loss=1.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and run.sent < 40:
        time.sleep(0.01)
    assert run.sent == 40
    srv.close()  # the connection, never accepted, goes away with its unread queue
    run.finish()
    assert accounted(run) == 40
    assert run.dropped["in_flight"] == 40  # none of them was ever read


def test_records_read_before_the_peer_went_away_are_not_in_flight(listener: Listener) -> None:
    """The send queue's byte count confirms the oldest packets as read even while newer ones
    wait, so an exporter that dies after reading most of them costs an upper bound close to
    what it did not read, not everything since the queue was last empty."""
    run = make_run(listener.path, flush_interval=0.0)
    run.log(0, loss=1.0)
    conn = listener.accept()
    deadline = time.monotonic() + 10
    for i in range(1, 200):
        run.log(i, loss=1.0)
        while run.sent < i + 1 and time.monotonic() < deadline:
            time.sleep(0.0005)  # one packet per step
    assert run.sent == 200
    conn.settimeout(5)
    for _ in range(1 + 150):  # the HELLO packet and 150 steps; 50 stay unread
        conn.recv(P.MAX_PACKET_BYTES + 1)
    run.log(200, loss=1.0)  # its flush sees 50 packets' worth of unread bytes
    while run.sent < 201 and time.monotonic() < deadline:
        time.sleep(0.001)
    conn.close()
    run.finish()
    unread = 51
    assert unread <= run.dropped["in_flight"] < 201
    assert accounted(run) == 201
