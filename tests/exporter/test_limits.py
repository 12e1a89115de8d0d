"""Connection and resource limits: what hostile or broken clients cannot do to the exporter.

Idle connections, a missing HELLO, exhausted file descriptors, a flooding trainer, slow HTTP
clients, concurrent scrapes and series blow-ups each meet a limit (a setting) and a counter,
while ``/healthz`` keeps answering and real trainers keep getting through.
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import json
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from trainmon_client import _protocol as P
from trainmon_exporter import Settings
from trainmon_exporter.collectors import CollectorContext
from trainmon_exporter.collectors.training import TrainingCollector
from trainmon_exporter.httplimits import CONNECTION, HttpStats
from trainmon_exporter.scrapes import SharedScrapes, scrape_format
from trainmon_exporter.state.admission import SERIES_PER_RANK
from trainmon_exporter.state.store import Store

from ..conftest import (
    ExporterProcess,
    InProcessExporter,
    child_env,
    connect,
    free_port,
    raw_connect,
    sample,
    short_tmpdir,
    wait_for,
)
from ..helpers.exporter import HELLO, dropped, hello, invalid, pkt, step


def refused(metrics: dict[Any, float], reason: str) -> float:
    return sample(metrics, "trainmon_ingest_connections_refused_total", reason=reason) or 0.0


def connect_retrying(path: str, timeout: float = 10.0) -> socket.socket:
    """A raw connection; a full listen queue (EAGAIN) is retried."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(path)
            s.setblocking(True)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.002)


def http_status(port: int, path: str) -> int:
    """One GET on a fresh connection (http.client: no client set-up cost in the timing)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", path)
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


def healthz_latencies(get: Callable[[], int], seconds: float, every: float = 0.05) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        assert get() == 200
        out.append(time.perf_counter() - t0)
        time.sleep(every)
    return out


def assert_fast(lat: list[float]) -> None:
    """/healthz within 100 ms (median); no answer over 1 s even on a loaded CI machine."""
    assert statistics.median(lat) < 0.1, lat
    assert max(lat) < 1.0, lat


# --------------------------------------------------------------------------- trainer connections


def test_connections_over_the_cap_are_refused_and_idle_ones_time_out(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    ex = make_exporter(ingest_max_connections=5, ingest_hello_timeout_seconds=0.5)
    socks = [connect_retrying(ex.socket) for _ in range(20)]
    m = wait_for(lambda: (m := ex.metrics()) and refused(m, "max_connections") == 15 and m)
    assert sample(m, "trainmon_ingest_open_connections") == 5
    assert sample(m, "trainmon_ingest_max_connections") == 5
    closed = 0
    for s in socks:  # refused ones read EOF at once
        s.settimeout(0.01)
        try:
            closed += s.recv(10) == b""
        except TimeoutError:
            pass
    assert closed == 15
    # The 5 held connections never say HELLO: closed after the deadline, counted.
    m = wait_for(lambda: (m := ex.metrics()) and refused(m, "hello_timeout") == 5 and m)
    assert sample(m, "trainmon_ingest_open_connections") == 0
    assert ex.client.get("/healthz").status_code == 200
    run = connect(ex, "after")
    run.log(1, loss=1.0)
    wait_for(lambda: (r := ex.rank("after", 0)) and r["step"] == 1)
    run.finish()
    for s in socks:
        s.close()


def test_idle_timeout_disconnects_without_calling_it_a_crash(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    ex = make_exporter(ingest_idle_timeout_seconds=0.3)
    s = raw_connect(ex.socket)
    s.send(pkt(hello(run="quiet"), step(1)))
    wait_for(lambda: refused(ex.metrics(), "idle_timeout") == 1)
    r = ex.rank("quiet", 0)
    assert r is not None and not r["up"] and r["status"] == "running"
    m = ex.metrics()
    assert sample(m, "trainmon_run_crashes_total", run="quiet", rank="0") == 0
    s.close()


class FailingAccept:
    """The listening socket as it behaves when the process is out of descriptors."""

    def __init__(self, real: socket.socket) -> None:
        self.real = real
        self.calls = 0

    def fileno(self) -> int:
        return self.real.fileno()

    def accept(self) -> Any:
        self.calls += 1
        raise OSError(errno.EMFILE, "Too many open files")


def test_emfile_pauses_accepting_with_backoff_instead_of_spinning(
    exporter: InProcessExporter,
) -> None:
    server = exporter.app.state.exporter.ingest
    real = server._sock
    failing = FailingAccept(real)
    server._sock = failing
    pending = raw_connect(exporter.socket)  # waits in the listen queue: the socket is readable
    time.sleep(1.0)
    # A busy loop calls accept() tens of thousands of times a second; the back-off 50 ms,
    # doubling to 1 s, about five times.
    assert 1 <= failing.calls <= 10, failing.calls
    assert refused(exporter.metrics(), "fd_limit") == failing.calls
    assert exporter.client.get("/healthz").status_code == 200
    server._sock = real  # descriptors are free again: the queued trainer gets in
    pending.send(pkt(hello(run="queued"), step(1)))
    wait_for(lambda: exporter.rank("queued", 0), timeout=5)
    pending.close()


def _nofile(n: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return limit


@pytest.mark.slow
def test_idle_connections_beyond_the_fd_limit_leave_the_exporter_serving() -> None:
    d = short_tmpdir()
    ex = ExporterProcess(d / "t.sock", free_port())
    cmd = [sys.executable, "-m", "trainmon_exporter", "--socket", ex.socket]
    cmd += ["--listen", f"127.0.0.1:{ex.port}", "--ingest-hello-timeout-seconds", "3"]
    cmd += ["--ingest-max-connections-per-uid", "1024"]  # one uid here: only the cap applies
    ex.proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(),
        preexec_fn=_nofile(256),
    )
    try:
        wait_for(ex.ready, timeout=20)
        proc = psutil.Process(ex.proc.pid)
        socks = [connect_retrying(ex.socket) for _ in range(400)]  # beyond 256 descriptors
        cpu0 = sum(proc.cpu_times()[:2])
        lat = healthz_latencies(lambda: http_status(ex.port, "/healthz"), 2.0)
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        assert cpu < 0.6, f"exporter used {cpu:.2f} s of CPU in 2 s: a busy loop?"
        assert_fast(lat)
        m = ex.metrics()
        cap = sample(m, "trainmon_ingest_max_connections")
        assert cap is not None and cap < 256  # lowered to the open-file limit
        assert sample(m, "trainmon_ingest_open_connections") == cap
        assert refused(m, "max_connections") == 400 - cap
        assert (sample(m, "process_open_fds") or 0) < 256
        for s in socks:
            s.close()
        wait_for(lambda: sample(ex.metrics(), "trainmon_ingest_open_connections") == 0)
        run = connect(ex, "after")
        run.log(1, loss=1.0)
        wait_for(lambda: any(r["run"] == "after" for r in ex.runs()["runs"]))
        run.finish()
    finally:
        out = ex.stop()
        import shutil

        shutil.rmtree(d, ignore_errors=True)
    assert out.count("\n") < 100, out[-2000:]  # the log stays bounded


# --------------------------------------------------------------------------- fair draining

FLOODER = """
import json, socket, sys, time
from trainmon_client import _protocol as P
hello = json.loads(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(P.packet_header() + P.encode_hello(hello))
st = P.step_struct(2)
n = P.step_payload_length(2)
packet = P.packet_header() + b"".join(
    st.pack(P.STEP, n, i, i, 1.0, 0.1, 0.0, 0.0, 0.0, 0, 0, 0, 1, 2, 1.0, 1e-3)
    for i in range(1, 600)
)
print("flooding", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    s.send(packet)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("poll", "n"), [("0.1", 1), ("0", 1), ("0.1", 4)])
def test_flooding_connections_starve_neither_trainers_nor_http(
    exporter_process: Callable[..., ExporterProcess], poll: str, n: int
) -> None:
    ex = exporter_process("--ingest-poll-interval-seconds", poll).start()
    flooders = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                FLOODER,
                ex.socket,
                "4",
                json.dumps(HELLO | {"run": "flood", "rank": i, "world_size": n}),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for i in range(n)
    ]
    for flooder in flooders:
        assert flooder.stdout is not None and flooder.stdout.readline() == "flooding\n"
    run = connect(ex, "normal", flush_interval=0.05)
    sent = [0]

    def train() -> None:
        for i in range(1, 201):  # 100 steps/s for 2 s
            run.log(i, loss=1.0, tokens=10)
            sent[0] = i
            time.sleep(0.01)

    t = threading.Thread(target=train)
    t.start()
    lat = healthz_latencies(lambda: http_status(ex.port, "/healthz"), 2.0)
    t.join()
    run.finish()
    for flooder in flooders:
        flooder.communicate(timeout=30)
    print("LAT", sorted(round(x * 1000) for x in lat))
    assert_fast(lat)
    assert sum(run.dropped.values()) == 0
    m = wait_for(
        lambda: (
            (m := ex.metrics())
            and sample(m, "trainmon_train_steps_total", run="normal", rank="0") == 200
            and m
        )
    )
    assert (sample(m, "trainmon_ingest_messages_total", type="step") or 0) > 1000  # it flooded


# --------------------------------------------------------------------------- HTTP


@pytest.mark.slow
def test_half_sent_http_requests_neither_pile_up_nor_stop_healthz(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    ex = exporter_process(
        "--http-limit-concurrency", "16", "--http-header-timeout-seconds", "1"
    ).start()
    proc = psutil.Process(ex.proc.pid)  # type: ignore[union-attr]
    slow = []
    for _ in range(100):
        s = socket.create_connection(("127.0.0.1", ex.port))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        slow.append(s)
    lat = healthz_latencies(lambda: http_status(ex.port, "/healthz"), 1.5)
    print("LAT", sorted(round(x * 1000) for x in lat))
    assert_fast(lat)
    held = [c for c in proc.net_connections("tcp") if c.status == "ESTABLISHED"]
    assert len(held) <= 16
    m = ex.metrics()
    closed = "trainmon_http_connections_closed_total"
    assert (sample(m, closed, reason="evicted") or 0) + (
        sample(m, closed, reason="header_timeout") or 0
    ) >= 100 - 16
    # A half-sent request alone is closed after the header timeout.
    s = socket.create_connection(("127.0.0.1", ex.port))
    s.sendall(b"GET /healthz HTTP/1.1\r\n")
    s.settimeout(5)
    t0 = time.monotonic()
    assert s.recv(100) == b""
    assert 0.5 < time.monotonic() - t0 < 4
    for c in [*slow, s]:
        c.close()


READERS = """
import sys, threading, urllib.error, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
stop = threading.Event()
codes = []
def read():
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                r.read()
                codes.append(r.status)
        except urllib.error.HTTPError as e:
            codes.append(e.code)
threads = [threading.Thread(target=read) for _ in range(n)]
for t in threads:
    t.start()
sys.stdin.readline()
stop.set()
for t in threads:
    t.join()
print(*codes)
"""


def _fill(path: str, ranks: int, names: int, first: int = 0) -> list[socket.socket]:
    """``ranks`` raw connections (runs ``r<first>``...): a HELLO and ``names`` NAMEs, then one
    step with a value for each name."""
    socks = []
    for r in range(first, first + ranks):
        s = raw_connect(path)
        ids = tuple(range(P.FIRST_CUSTOM_ID, P.FIRST_CUSTOM_ID + names))
        records = [hello(run=f"r{r}")] + [P.encode_name(i, f"metric_{i}") for i in ids]
        s.send(pkt(*records))
        try:
            s.send(pkt(step(1, ids, tuple(float(i) for i in ids))))
        except OSError:  # the HELLO was refused and the connection closed
            pass
        socks.append(s)
    return socks


# One uid (the test's own) opens every run: its rank and series quotas are the node's.
ONE_UID_FILLS = ("--max-series-per-uid", "50000", "--max-ranks-per-uid", "256")


def unread_request(port: int, path: str) -> socket.socket:
    """A GET of ``path`` whose answer is never read (a 4 KiB receive buffer): it waits."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


@pytest.mark.slow
def test_concurrent_and_unread_scrapes_are_bounded_and_ingest_keeps_applying(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    ex = exporter_process(
        "--http-max-concurrent-scrapes", "2", "--http-write-timeout-seconds", "1", *ONE_UID_FILLS
    ).start()
    socks = _fill(ex.socket, 64, 250)
    lazy: list[socket.socket] = []
    readers = None
    try:  # sockets closed and readers stopped even when an assertion fails
        wait_for(lambda: len(ex.runs()["runs"]) == 64)
        for _ in range(4):  # request /metrics and never read the answer
            lazy.append(unread_request(ex.port, "/metrics"))
        # Four readers in a process of their own (their parsing must not slow this one's probes).
        readers = subprocess.Popen(
            [sys.executable, "-c", READERS, ex.url + "/metrics", "4"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        run = connect(ex, "normal", flush_interval=0.05)
        for i in range(1, 101):
            run.log(i, loss=1.0)
            time.sleep(0.02)
        lat = healthz_latencies(lambda: http_status(ex.port, "/healthz"), 1.0)
        out, _ = readers.communicate("stop\n", timeout=60)
        codes = [int(c) for c in out.split()]
        assert_fast(lat)
        runs = {r["run"]: r for r in ex.runs()["runs"]}
        assert runs["normal"]["ranks"][0]["step"] == 100  # ingest kept applying meanwhile
        assert codes and set(codes) == {200}  # every scrape answered, none refused
        m = ex.metrics()
        closed = "trainmon_http_connections_closed_total"
        # The unread answers were closed: for newer bodies, or after the write timeout.
        unread = sample(m, closed, reason="unread") or 0
        assert unread + (sample(m, closed, reason="write_timeout") or 0) >= 4
        run.finish()
    finally:
        if readers is not None and readers.poll() is None:
            readers.kill()
            readers.communicate()
        for s in socks + lazy:
            s.close()


def test_scrapes_share_collections_that_start_after_they_arrive() -> None:
    """20 scrapes 10 ms apart against 50 ms collections: each collection serves every scrape
    that arrived while the previous one ran, none gets data collected before it arrived,
    and the bodies are let go once sent."""
    scrapes = SharedScrapes(4, HttpStats())
    started: list[float] = []

    def render() -> bytes:
        started.append(time.monotonic())
        time.sleep(0.05)
        return str(len(started) - 1).encode()

    async def sent(response: Any) -> bytes:
        chunks: list[bytes] = []

        async def send(message: dict[str, Any]) -> None:
            chunks.append(message.get("body", b""))

        await response({}, None, send)
        return b"".join(chunks)

    async def one(delay: float) -> tuple[float, bytes]:
        await asyncio.sleep(delay)
        arrived = time.monotonic()
        return arrived, await sent(await scrapes.response("k", render, "text/plain", {}))

    async def run() -> list[tuple[float, bytes]]:
        return list(await asyncio.gather(*(one(i * 0.01) for i in range(20))))

    results = asyncio.run(run())
    assert len(started) <= 8, len(started)  # about 200 ms of arrivals / 50 ms, not 20
    assert scrapes.collections == len(started)
    for arrived, body in results:
        assert started[int(body)] >= arrived  # collected after the scrape arrived
    assert scrapes.held == 0


def test_concurrent_scrapes_are_all_answered_by_shared_collections(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    """Eight scrapes at once against a collection of 0.2 s: every one answered, by a few
    collections rather than one each (each used to make its own, four at a time, the rest
    refused with 503)."""
    ex = make_exporter()
    scrape = ex.app.state.exporter.scrape
    real = scrape.collect
    calls = [0]

    def slow_collect() -> Any:
        calls[0] += 1
        time.sleep(0.2)
        return real()

    scrape.collect = slow_collect
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda: statuses.append(ex.client.get("/metrics").status_code))
        for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert statuses == [200] * 8
    assert calls[0] <= 3, calls[0]  # the first, and one shared by those that came during it


def test_a_new_body_closes_the_answers_read_least_recently() -> None:
    stats = HttpStats()
    scrapes = SharedScrapes(2, stats)
    closed: list[str] = []

    def scope(name: str) -> dict[str, Any]:
        return {"extensions": {CONNECTION: {"abort": lambda reason: closed.append(name)}}}

    async def run() -> list[Any]:
        out = []
        for name in ("a", "b", "c", "d"):  # one after another: a body each, none sent yet
            out.append(await scrapes.response("k", lambda: b"x" * 10, "text/plain", scope(name)))
            out[-1].delivery.progress = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 0.0}[name]
        return out

    responses = asyncio.run(run())
    # c's body came while a and b were held: b (less recent progress) was closed; then d's
    # came while a and c were held (d's own progress does not count): c went.
    assert closed == ["b", "c"]
    assert [r.delivery.evicted for r in responses] == [False, True, True, False]
    assert scrapes.held == 2


@pytest.mark.parametrize(
    ("accept", "same_as"),
    [
        ("", "text/plain"),
        ("text/plain;version=0.0.4", "text/plain"),
        ("application/openmetrics-text;version=1.0.0", "om"),
        ("application/openmetrics-text;version=1.0.7", "om"),
        ("application/openmetrics-text", "om"),
    ],
)
def test_scrapes_that_differ_only_in_version_share_a_collection(accept: str, same_as: str) -> None:
    key, content_type, _ = scrape_format(accept)
    base = "application/openmetrics-text;version=1.0.0" if same_as == "om" else ""
    assert key == scrape_format(base)[0]
    if "1.0.7" in accept:
        assert "version=1.0.7" in content_type  # the client's version is still echoed
    assert key != scrape_format("application/openmetrics-text;version=1.0.0;escaping=dots")[0]


def established(ex: ExporterProcess) -> int:
    """TCP connections the exporter holds (its listening socket aside)."""
    proc = psutil.Process(ex.proc.pid)  # type: ignore[union-attr]
    return sum(1 for c in proc.net_connections("tcp") if c.status == "ESTABLISHED")


def scrape_status(port: int) -> int:
    """The status of one /metrics GET whose body is read in full."""
    return http_status(port, "/metrics")


@pytest.mark.slow
def test_clients_that_never_read_cannot_keep_a_scrape_out(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    """Unread /metrics answers hold no slot: every scrape is answered, and what they pin is
    bounded (the connection limit and ``http_max_concurrent_scrapes`` bodies), not by time."""
    ex = exporter_process(
        "--http-write-timeout-seconds",
        "60",
        "--http-limit-concurrency",
        "16",
        "--scrape-sample-limit",
        "100000",
        *ONE_UID_FILLS,
    ).start()
    socks = _fill(ex.socket, 64, 250)
    lazy: list[socket.socket] = []
    try:
        wait_for(lambda: len(ex.runs()["runs"]) == 64)
        size = len(ex.get("/metrics"))
        assert size > 1_000_000  # more than the socket buffers: an unread answer waits
        # As many unread requests as there are body slots (4, the default), then scrapes.
        lazy += [unread_request(ex.port, "/metrics") for _ in range(4)]
        time.sleep(0.5)
        assert [scrape_status(ex.port) for _ in range(3)] == [200] * 3
        # Every connection slot but one taken by unread answers (they share their bodies):
        # a scrape still gets in, closing the answer left unread longest.
        lazy += [unread_request(ex.port, "/metrics") for _ in range(15 - len(lazy))]
        time.sleep(0.5)
        assert [scrape_status(ex.port) for _ in range(3)] == [200] * 3
        m = ex.metrics()
        closed = "trainmon_http_connections_closed_total"
        assert (sample(m, closed, reason="unread") or 0) >= 1
        # Each unread request given a body of its own: at most 4 bodies stay held, the
        # answers read least recently are closed to make room for newer ones.
        for _ in range(8):
            lazy.append(unread_request(ex.port, "/metrics"))
            time.sleep(0.05)
            assert scrape_status(ex.port) == 200
        wait_for(lambda: established(ex) <= 4)
        assert (sample(ex.metrics(), closed, reason="write_timeout") or 0) == 0
    finally:
        for s in socks + lazy:
            s.close()


@pytest.mark.slow
def test_unread_api_requests_are_bounded_and_their_slots_come_back(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    ex = exporter_process(
        "--http-max-concurrent-api", "2", "--http-write-timeout-seconds", "1", *ONE_UID_FILLS
    ).start()
    socks = _fill(ex.socket, 128, 250)
    lazy: list[socket.socket] = []
    try:
        wait_for(lambda: len(ex.runs()["runs"]) == 128)
        size = len(json.dumps(ex.runs()))
        assert size > 600_000  # more than the socket buffers (2 x 256 KiB): the answers wait
        for _ in range(20):  # request the JSON API and never read the answer
            lazy.append(unread_request(ex.port, "/api/v1/runs"))
        time.sleep(0.3)
        c = http.client.HTTPConnection("127.0.0.1", ex.port, timeout=10)
        c.request("GET", "/api/v1/gpus")
        r = c.getresponse()
        r.read()
        c.close()
        assert r.status == 503 and r.getheader("Retry-After") == "1"
        assert http_status(ex.port, "/") == 503  # the status page shares the gate
        assert_fast(healthz_latencies(lambda: http_status(ex.port, "/healthz"), 0.5))
        assert http_status(ex.port, "/metrics") == 200  # scrapes have their own gate
        m = ex.metrics()
        assert (sample(m, "trainmon_http_requests_refused_total", reason="api_limit") or 0) >= 20
        # The unread answers are aborted after the write timeout and their slots come back.
        wait_for(lambda: http_status(ex.port, "/api/v1/gpus") == 200, timeout=20)
        m = ex.metrics()
        assert (
            sample(m, "trainmon_http_connections_closed_total", reason="write_timeout") or 0
        ) >= 2
    finally:
        for s in socks + lazy:
            s.close()


# --------------------------------------------------------------------------- scrapes vs the lock


def test_a_scrape_never_holds_the_store_lock_for_long() -> None:
    store = Store(max_ranks=2000, max_custom_metrics=256, buckets=(1.0,), window_s=30, ttl_s=60)
    for r in range(1500):
        s = store.attach(HELLO | {"run": f"r{r}"})
        assert not isinstance(s, str)
        s.custom = {f"m{i}": float(i) for i in range(100)}
    collector = TrainingCollector(CollectorContext(Settings(), store))
    done = threading.Event()
    t0 = time.perf_counter()

    def scrape() -> None:
        list(collector.collect())
        done.set()

    threading.Thread(target=scrape).start()
    waits = []
    while not done.is_set():
        w0 = time.perf_counter()
        with store.lock:  # what ingest does for every packet
            waits.append(time.perf_counter() - w0)
        time.sleep(0.001)
    took = time.perf_counter() - t0
    assert took > 0.3, "the scrape was too quick to tell anything"
    assert max(waits) < took / 3, (max(waits), took)


# --------------------------------------------------------------------------- series and names


def test_operations_are_capped_per_rank(make_exporter: Callable[..., InProcessExporter]) -> None:
    ex = make_exporter(max_operations=8)
    s = raw_connect(ex.socket)
    records = [hello(run="ops")]
    for i in range(300):  # one id rebound to 300 names, each tracked
        records += [P.encode_name(100, f"op{i}"), P.encode_track(100, False, 1.0, 1)]
    s.send(pkt(*records))
    wait_for(lambda: dropped(ex, "operation_cap") == 292)
    text = ex.metrics_text()
    assert text.count("trainmon_monitoring_operations_total{") == 8
    s.close()


def test_the_series_budget_bounds_the_whole_exposition(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    ex = make_exporter(max_series=2000)
    socks: list[socket.socket] = []
    for r in range(10):  # 10 x (100 + 250) = 3,500 series wanted, one trainer after another
        socks += _fill(ex.socket, 1, 250, first=r)

        def read(r: int = r) -> bool:  # its step applied, or its HELLO refused
            m = ex.metrics()
            steps = sample(m, "trainmon_ingest_messages_total", type="step") or 0
            return steps + invalid(ex, "series_budget") >= r + 1

        wait_for(read)
    m = wait_for(lambda: (m := ex.metrics()) and dropped(ex, "series_budget") > 0 and m)
    used = sample(m, "trainmon_exporter_series")
    assert used is not None and used <= 2000
    customs = sum(1 for k in m if k[0] == "trainmon_train_custom_value")
    ranks = len({dict(k[1]).get("run") for k in m if k[0] == "trainmon_run_up"})
    assert 0 < ranks < 10 and ranks * SERIES_PER_RANK + customs <= 2000
    # Once the budget is spent by connected ranks, a new rank is refused too.
    wait_for(lambda: invalid(ex, "series_budget") == 10 - ranks)
    for s in socks:
        s.close()


# --------------------------------------------------------------------------- eviction


def test_finished_then_crashed_ranks_make_room_for_live_ones(
    make_exporter: Callable[..., InProcessExporter],
) -> None:
    ex = make_exporter(max_ranks=2, rank_retention_seconds=0)
    done = raw_connect(ex.socket)
    done.send(pkt(hello(run="done"), step(1), P.encode_finish(P.FINISH_OK, 2.0)))
    crashed = raw_connect(ex.socket)
    crashed.send(pkt(hello(run="crashed"), step(1)))
    wait_for(lambda: ex.rank("done", 0) and ex.rank("crashed", 0))
    crashed.close()  # first to disconnect, but crashed ranks go after finished ones
    wait_for(lambda: (r := ex.rank("crashed", 0)) and r["status"] == "crashed")
    done.close()
    wait_for(lambda: (r := ex.rank("done", 0)) and not r["up"])
    live = []
    for run in ("new1", "new2"):
        s = raw_connect(ex.socket)
        s.send(pkt(hello(run=run), step(1)))
        live.append(s)
        wait_for(lambda run=run: ex.rank(run, 0))  # type: ignore[misc]
        if run == "new1":
            assert ex.rank("done", 0) is None and ex.rank("crashed", 0) is not None
    assert ex.rank("crashed", 0) is None
    m = ex.metrics()
    assert sample(m, "trainmon_exporter_ranks_evicted_total", status="finished") == 1
    assert sample(m, "trainmon_exporter_ranks_evicted_total", status="crashed") == 1
    # Every pair connected now: a third live rank is refused, nobody is evicted.
    s = raw_connect(ex.socket)
    s.send(pkt(hello(run="new3"), step(1)))
    wait_for(lambda: invalid(ex, "too_many_ranks") == 1)
    for c in [*live, s]:
        c.close()


def test_an_evicted_run_stays_its_owners_until_the_ttl() -> None:
    store = Store(max_ranks=1, max_custom_metrics=8, buckets=(1.0,), window_s=30, ttl_s=60)
    a = store.attach(HELLO | {"run": "mine"}, uid=1000)
    assert not isinstance(a, str)
    a.disconnect(finished=False)  # crashed
    b = store.attach(HELLO | {"run": "other"}, uid=1000)  # evicts "mine"
    assert not isinstance(b, str) and store.admission.evicted["crashed"] == 1
    assert ("mine", 0) not in store.ranks
    b.disconnect(finished=True)
    assert store.attach(HELLO | {"run": "mine"}, uid=2000) == "not_owner"
    c = store.attach(HELLO | {"run": "mine"}, uid=1000)  # its owner may resume it
    assert not isinstance(c, str) and c.owner_uid == 1000
    # After the TTL the record lapses and the id is free again.
    c.disconnect(finished=True)
    x = store.attach(HELLO | {"run": "x"}, uid=5)  # evicts "mine" again
    assert not isinstance(x, str) and store.owners["mine"][0] == 1000
    x.disconnect(finished=True)
    store.owners["mine"] = (1000, time.monotonic() - 1)
    d = store.attach(HELLO | {"run": "mine"}, uid=2000)
    assert not isinstance(d, str) and d.owner_uid == 2000


def test_owner_records_are_bounded() -> None:
    store = Store(max_ranks=1, max_custom_metrics=8, buckets=(1.0,), window_s=30, ttl_s=60)
    for i in range(50):
        s = store.attach(HELLO | {"run": f"r{i}"}, uid=1000)
        assert not isinstance(s, str)
        s.disconnect(finished=True)
    assert len(store.owners) <= store.max_owner_records == 4
