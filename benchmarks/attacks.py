"""The exporter under hostile load: what it holds, and how fast /healthz and /metrics answer.

Each attack runs against a fresh exporter subprocess while a prober GETs ``/healthz`` every
50 ms on a new connection (as a kubelet would):

- ``idle``: 1,100 Unix connections that never send a byte, exporter limited to 1,024 open
  files; then a real trainer connects and logs 20 steps.
- ``http``: 1,000 TCP connections that send half an HTTP request and stop.
- ``flood``: one connection sends valid STEP packets as fast as it can while a real trainer
  logs 100 steps/s; how many of the trainer's steps the exporter applied.
- ``multi_flood``: 8 connections of one uid send valid STEP packets flat out while a trainer
  of another uid logs 100 steps/s: its applied/sent steps, ``/healthz`` p50/p99.
- ``scrapes``: 64 ranks with 256 custom metrics each (one uid; its quotas and the scrape sample
  limit raised so the whole exposition is served); 4 threads read ``/metrics`` in a loop
  and 4 connections request it without reading the answer, while a trainer logs 100 steps/s.
- ``never_read``: the same 64 ranks; 4 connections request ``/metrics`` and never read the
  answer, each reopened as soon as the exporter closes it, while a Prometheus-like scraper
  GETs ``/metrics`` every second (10 s timeout): how many of its scrapes are answered, against
  the same scraper alone just before; unread answers closed; RSS.
- ``series``: one client within every per-rank cap (256 runs x (256 custom metrics + 128
  layers)) plus 100,000 ``Run.track`` operation names: exposition size, scrape time, RSS.
- ``hello_churn``: the rank table full (``--max-ranks 64``) of live ranks; short connections
  send new HELLOs flat out: HELLOs/s, exporter CPU, ``/healthz`` p50, live ranks kept.
- ``api_memory``: 60 ``/api/v1/runs`` requests (128 ranks of one uid, its quotas raised to
  admit them) never read: RSS before, during, after.
- ``ownership_churn``: a victim's rank crashes; another uid makes short connections flat out
  (HELLOs of new runs and of the victim's run): is the crashed rank still the victim's, and
  can the victim reconnect?
- ``squat``: one uid opens 1,100 idle HELLO-only connections; a trainer of another uid must
  still get in and lose nothing.
- ``uid_squat``: one root process switches its effective uid four times and holds 64 idle
  HELLO-only connections under each (every one of the 256 rank slots, each uid at its quota
  of a quarter); a trainer of a fifth uid logs 40 steps: how many arrive, which uids hold the
  slots (``trainmon_exporter_tenant_ranks``), what the squatters were told.
- ``uid_squat_connections``: the same process holds 256 connections without a HELLO under
  each of four uids (every one of the 1,024 connection slots; HELLO timeout raised to 60 s);
  a trainer of a fifth uid logs 40 steps.
- ``signal_storm``: a trainer whose 2 kHz timer signal handler calls ``run.log()`` while its
  loop logs: does it complete (killed after a timeout if not)?
- ``extreme_sparklines``: a rank logs the float range's ends (-1e308, +1e308, the largest
  float, the smallest subnormal) as its loss and grad norm: does ``trainmon status`` (the live
  view, stopped with Ctrl-C after a few refreshes) keep drawing, and does the status page draw
  its sparklines at finite coordinates? Prints the sparkline row the live view showed.

Each prints its figures and, for each property it checks, ``held`` or ``NOT held``. Attacks
that need a second uid run their clients as uids 61001 and 61002 when run as root, and print
``skipped: needs root`` otherwise. A benchmark that needs more descriptors than the soft
open-file limit raises it up to the hard limit, or scales its connection count down, and
prints a line saying which.

    python benchmarks/attacks.py [idle http flood multi_flood ...] [--hold 8]
    python benchmarks/attacks.py --smoke   # every attack held 0.3 s (figures not meaningful)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from _harness import (
    ROOT,
    UID_A,
    UID_B,
    Exporter,
    Prober,
    as_uid,
    fd_budget,
    get,
    hello,
    latency_summary,
    raw_connect,
    step_records,
)

import trainmon_client
from trainmon_client import _protocol as P

FLOODER = """
import socket, sys, time
sys.path.insert(0, sys.argv[3])
from _harness import hello, step_records, raw_connect
from _harness import DROP
from trainmon_client import _protocol as P
exec(DROP)
s = raw_connect(sys.argv[1], timeout=None)
rank = int(sys.argv[4]) if len(sys.argv) > 4 else 0
s.send(P.packet_header() + hello("flood", rank, rank + 1))
pkt = P.packet_header() + step_records(0, 400)  # ~24 KB, 400 steps
end = time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < end:
    try:
        s.send(pkt)
        n += 1
    except OSError:
        break
print(n * 400)
"""


TRAINER = """
import sys, time
import trainmon_client
sys.path.insert(0, sys.argv[5])
from _harness import DROP
exec(DROP)
sock, run, rate, hold = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
r = trainmon_client.init(run=run, rank=0, world_size=1, socket_path=sock)
i = 0
t0 = time.perf_counter()
while time.perf_counter() - t0 < hold:
    r.log(i, loss=1.0, lr=1e-3, tokens=100)
    i += 1
    delay = t0 + i / rate - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
r.finish()
print(i, sum(r.dropped.values()))
"""


def _here() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def _flooders(sock: str, n: int, hold: float, uid: int | None) -> list[subprocess.Popen[str]]:
    """``n`` flooder processes (one connection each, ranks 0..n-1 of run ``flood``)."""
    return [
        subprocess.Popen(
            [sys.executable, "-c", FLOODER, sock, str(hold), _here(), str(i)],
            stdout=subprocess.PIPE,
            text=True,
            **as_uid(uid),
        )
        for i in range(n)
    ]


def _trainer_process(
    sock: str, run: str, rate: float, hold: float, uid: int | None
) -> subprocess.Popen[str]:
    """A real client (another process, as ``uid``) logging ``rate`` steps/s for ``hold`` s;
    prints ``sent dropped``."""
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, sock, run, str(rate), str(hold), _here()],
        stdout=subprocess.PIPE,
        text=True,
        **as_uid(uid),
    )


def _trainer(sock: str, run: str, rate: float, stop: threading.Event, out: dict[str, int]) -> None:
    r = trainmon_client.init(run=run, rank=0, world_size=1, socket_path=sock)
    i = 0
    t0 = time.perf_counter()
    while not stop.is_set():
        r.log(i, loss=1.0, lr=1e-3, tokens=100)
        i += 1
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    r.finish()
    out["sent"] = i
    out["dropped"] = sum(r.dropped.values())


def _held(ok: bool) -> str:
    """How a report line says whether a property held."""
    return "held" if ok else "NOT held"


def _unread(port: int, path: str) -> socket.socket:
    """A GET of ``path`` whose answer is never read (a 4 KiB receive buffer): it waits."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


def _report(name: str, ex: Exporter, prober: Prober, cpu0: float, t0: float, extra: str) -> None:
    dt = time.monotonic() - t0
    cpu = (ex.cpu_seconds() - cpu0) / dt * 100
    print(f"[{name}] /healthz {prober.summary()}")
    print(
        f"[{name}] exporter CPU {cpu:.0f} % of a core, log {ex.log_lines:,} lines "
        f"({ex.log_bytes / 1e6:.2f} MB), RSS {ex.rss_mib():.0f} MiB; {extra}"
    )


def idle(hold: float) -> None:
    n = fd_budget(1100, "idle")
    # The exporter's limit stays below the connections opened (1,024 for 1,100), so the attack
    # still goes beyond it when scaled down. One uid opens them all: its quota is lifted, so
    # the cap and the descriptor limit are what this attack meets (squat tests the quota).
    nofile = min(1024, n * 1024 // 1100)
    with Exporter("--ingest-max-connections-per-uid", "1024", nofile=nofile) as ex:
        print(f"[idle] exporter open-file limit {ex.nofile}, {n} idle connections")
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        socks = []
        refused = 0
        for _ in range(n):
            try:
                socks.append(raw_connect(ex.socket, timeout=0.5))
            except OSError:
                refused += 1
        time.sleep(hold)
        held = ex.metric("trainmon_ingest_open_connections", timeout=5)
        _report(
            "idle",
            ex,
            prober.stop(),
            cpu0,
            t0,
            f"{len(socks)} connects succeeded, {refused} failed; open connections in "
            f"/metrics: {held}",
        )
        for s in socks:
            s.close()
        out: dict[str, int] = {}
        stop = threading.Event()
        th = threading.Thread(target=_trainer, args=(ex.socket, "after", 50, stop, out))
        th.start()
        time.sleep(1.0)
        stop.set()
        th.join()
        time.sleep(0.5)
        applied = ex.metric('trainmon_train_steps_total{rank="0",run="after"}', timeout=10)
        print(f"[idle] a trainer afterwards: sent {out['sent']}, exporter has {applied}")


def http_half(hold: float) -> None:
    with Exporter() as ex:
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        socks = []
        for _ in range(fd_budget(1000, "http")):
            try:
                s = socket.create_connection(("127.0.0.1", ex.port), timeout=1)
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                socks.append(s)
            except OSError:
                pass
        time.sleep(hold)
        open_now = sum(1 for c in ex.ps.net_connections("tcp") if c.status == "ESTABLISHED")
        _report(
            "http",
            ex,
            prober.stop(),
            cpu0,
            t0,
            f"{len(socks)} half-sent requests, {open_now} still open at the exporter",
        )
        for s in socks:
            s.close()


def flood(hold: float) -> None:
    with Exporter() as ex:
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        here = os.path.dirname(os.path.abspath(__file__))
        fl = subprocess.Popen(
            [sys.executable, "-c", FLOODER, ex.socket, str(hold), here],
            stdout=subprocess.PIPE,
            text=True,
        )
        out: dict[str, int] = {}
        stop = threading.Event()
        th = threading.Thread(target=_trainer, args=(ex.socket, "normal", 100, stop, out))
        th.start()
        flooded = int(fl.communicate(timeout=hold + 60)[0] or 0)
        stop.set()
        th.join()
        prober.stop()
        time.sleep(1.0)
        applied = ex.metric('trainmon_train_steps_total{rank="0",run="normal"}', timeout=30)
        fl_applied = ex.metric('trainmon_ingest_messages_total{type="step"}', timeout=30)
        _report(
            "flood",
            ex,
            prober,
            cpu0,
            t0,
            f"flooder sent {flooded:,} steps, exporter applied {fl_applied}; normal trainer "
            f"sent {out['sent']}, client-dropped {out['dropped']}, exporter applied {applied}",
        )


def _fill(sock: str, ranks: int, n_custom: int, layers: int = 0) -> list[socket.socket]:
    """``ranks`` raw connections (runs r0..), each binding ``n_custom`` names and one step."""
    conns = []
    for r in range(ranks):
        s = raw_connect(sock)
        recs = [hello(f"r{r}")]
        recs += [P.encode_name(P.FIRST_CUSTOM_ID + i, f"m{i}") for i in range(n_custom)]
        recs += [P.encode_name(P.FIRST_CUSTOM_ID + 512 + i, f"l{i}") for i in range(layers)]
        _send_records(s, recs)
        _send_records(s, [step_records(0, 1, n_custom)])
        if layers:
            codes = list(range(12))
            rec = P.encode_layers(
                0,
                time.time(),
                1,
                0.0,
                [P.FIRST_CUSTOM_ID + 512 + i for i in range(layers)],
                codes,
                [0.5] * (layers * len(codes)),
            )
            _send_records(s, [rec])
        conns.append(s)
    return conns


def _send_records(s: socket.socket, recs: list[bytes]) -> None:
    cur = bytearray(P.packet_header())
    for rec in recs:
        if len(cur) + len(rec) > 60000:
            s.send(bytes(cur))
            cur = bytearray(P.packet_header())
        cur += rec
    if len(cur) > 4:
        s.send(bytes(cur))


def scrapes(hold: float) -> None:
    ranks = fd_budget(64 + 8, "scrapes") - 8  # 8: the scrapers' and lazy readers' sockets
    # One uid holds the 64 ranks and the trainer: its rank and series quotas and the scrape's
    # sample limit are raised so the whole exposition is served and the trainer gets in.
    quotas = ("--max-ranks-per-uid", "128", "--max-series-per-uid", "50000")
    with Exporter(*quotas, "--scrape-sample-limit", "100000") as ex:
        conns = _fill(ex.socket, ranks, 256)
        time.sleep(1.0)
        size = len(get(ex.port, "/metrics", timeout=60)[1])
        print(f"[scrapes] exposition {size / 1e6:.1f} MB")
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        stop = threading.Event()
        lat: list[float] = []
        fails = [0]

        def reader() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    st, _ = get(ex.port, "/metrics", timeout=30)
                    if st == 200:
                        lat.append(time.perf_counter() - t)
                    else:
                        fails[0] += 1
                        time.sleep(0.1)
                except OSError:
                    fails[0] += 1

        readers = [threading.Thread(target=reader, daemon=True) for _ in range(4)]
        for th in readers:
            th.start()
        lazy = [_unread(ex.port, "/metrics") for _ in range(4)]
        out: dict[str, int] = {}
        tstop = threading.Event()
        th = threading.Thread(target=_trainer, args=(ex.socket, "normal", 100, tstop, out))
        th.start()
        time.sleep(hold)
        tstop.set()
        th.join()
        t_end = time.monotonic()
        applied_now = None
        while applied_now is None and time.monotonic() - t_end < 30:
            # a scrape that fails (a timeout under load) is tried again
            with contextlib.suppress(Exception):
                applied_now = ex.metric('trainmon_train_steps_total{rank="0",run="normal"}')
        lag = time.monotonic() - t_end
        stop.set()
        for r in readers:
            r.join(60)
        prober.stop()
        _report(
            "scrapes",
            ex,
            prober,
            cpu0,
            t0,
            f"/metrics {latency_summary(lat, fails[0])}; trainer sent {out['sent']}, "
            f"applied {applied_now} (read {lag:.1f} s after it stopped)",
        )
        for s in lazy + conns:
            s.close()


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the exporter reset or closed ``s`` (an unread request's connection)."""
    return s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0


def _scrape_every(port: int, seconds: float, every: float = 1.0) -> tuple[list[float], list[str]]:
    """GET /metrics every ``every`` s for ``seconds`` (10 s timeout, as Prometheus' default):
    latencies of the answers, and what became of the others (``503``, ``timeout``...)."""
    lat: list[float] = []
    bad: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        try:
            st, _ = get(port, "/metrics", timeout=10)
            if st == 200:
                lat.append(time.perf_counter() - t)
            else:
                bad.append(str(st))
        except OSError as exc:
            bad.append(type(exc).__name__)
        time.sleep(max(0.0, every - (time.perf_counter() - t)))
    return lat, bad


def never_read(hold: float) -> None:
    """4 /metrics requests never read, reopened when closed; a Prometheus-like scraper beside."""
    ranks = fd_budget(64 + 8, "never_read") - 8
    quotas = ("--max-ranks-per-uid", "128", "--max-series-per-uid", "50000")
    with Exporter(*quotas, "--scrape-sample-limit", "100000") as ex:
        conns = _fill(ex.socket, ranks, 256)
        time.sleep(1.0)
        size = len(get(ex.port, "/metrics", timeout=60)[1])
        base_lat, base_bad = _scrape_every(ex.port, max(2.0, hold / 2))
        rss0 = ex.rss_mib()
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        stop = threading.Event()
        reopened = [0]
        rss_max = [rss0]

        def squat() -> None:
            lazy = [_unread(ex.port, "/metrics") for _ in range(4)]
            while not stop.wait(0.05):
                for i, s in enumerate(lazy):
                    if _closed_by_peer(s):
                        s.close()
                        lazy[i] = _unread(ex.port, "/metrics")
                        reopened[0] += 1
                rss_max[0] = max(rss_max[0], ex.rss_mib())
            for s in lazy:
                s.close()

        squatter = threading.Thread(target=squat, daemon=True)
        squatter.start()
        time.sleep(0.5)  # the four unread answers are waiting before the first scrape
        lat, bad = _scrape_every(ex.port, hold)
        stop.set()
        squatter.join(30)
        prober.stop()
        closed = ex.metric('trainmon_http_connections_closed_total{reason="unread"}')
        timeouts = ex.metric('trainmon_http_connections_closed_total{reason="write_timeout"}')
        tried = len(lat) + len(bad)
        base_tried = len(base_lat) + len(base_bad)
        ok = not bad and tried > 0
        ratio = statistics.median(lat) / statistics.median(base_lat) if lat and base_lat else 0.0
        _report(
            "never_read",
            ex,
            prober,
            cpu0,
            t0,
            f"exposition {size / 1e6:.1f} MB; scrapes alone first: {len(base_lat)} of "
            f"{base_tried} answered ({latency_summary(base_lat, len(base_bad))}); beside 4 "
            f"connections that never read (reopened {reopened[0]} times as the exporter closed "
            f"them: unread {closed}, write_timeout {timeouts}): {len(lat)} of {tried} answered "
            f"({', '.join(bad) or 'none refused or failed'}; {latency_summary(lat, len(bad))}, "
            f"p50 {ratio:.1f}x alone); every scrape answered {_held(ok)}; RSS {rss0:.0f} MiB "
            f"before, at most {rss_max[0]:.0f} during",
        )
        for c in conns:
            c.close()


def series(hold: float) -> None:
    ranks = fd_budget(256, "series")
    with Exporter() as ex:
        rss0 = ex.rss_mib()
        t = time.perf_counter()
        conns = _fill(ex.socket, ranks, 256, layers=128)
        s = conns[0]
        recs = []
        for i in range(100_000):
            recs += [P.encode_name(70000 % 65536, f"op{i}"), P.encode_track(70000 % 65536, 0, 1, 1)]
        try:
            _send_records(s, recs)
        except OSError as exc:  # the exporter may close a connection it judges abusive
            refused = ex.metric("trainmon_ingest_connections_refused_total")
            print(f"[series] exporter closed the connection ({exc}); refusals counted: {refused}")
        print(f"[series] sent in {time.perf_counter() - t:.1f} s")
        time.sleep(2.0)
        t = time.perf_counter()
        try:
            status, body = get(ex.port, "/metrics", timeout=120)
            dt = time.perf_counter() - t
            lines = body.count(b"\n")
            print(
                f"[series] /metrics {status}: {len(body) / 1e6:.1f} MB in {dt:.1f} s, "
                f"{lines:,} lines; RSS {rss0:.0f} -> {ex.rss_mib():.0f} MiB"
            )
        except OSError as exc:
            print(f"[series] /metrics failed: {exc}; RSS {ex.rss_mib():.0f} MiB")
        for c in conns:
            c.close()


def multi_flood(hold: float, n: int = 8) -> None:
    """``n`` connections of one uid flood; a trainer of another uid logs 100 steps/s."""
    uid_f, uid_t = (UID_A, UID_B) if ROOT else (None, None)
    who = f"uid {UID_A}, trainer uid {UID_B}" if ROOT else "one uid for all (not root)"
    with Exporter(shared=True) as ex:
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        fls = _flooders(ex.socket, n, hold, uid_f)
        tr = _trainer_process(ex.socket, "normal", 100, hold, uid_t)
        sent, dropped = (int(x) for x in tr.communicate(timeout=hold + 60)[0].split())
        flooded = sum(int(f.communicate(timeout=hold + 60)[0] or 0) for f in fls)
        prober.stop()
        time.sleep(1.0)
        applied = ex.metric('trainmon_train_steps_total{rank="0",run="normal"}', timeout=30)
        held = "held" if applied == sent and dropped == 0 else "NOT held"
        p50 = prober.p50_ms()
        _report(
            "multi_flood",
            ex,
            prober,
            cpu0,
            t0,
            f"{n} flooding connections ({who}) sent {flooded:,} steps; trainer sent {sent}, "
            f"client-dropped {dropped}, exporter applied {applied}: no step lost {held}; "
            f"/healthz p50 under 100 ms {_held(p50 < 100)}",
        )


CHURNER = """
import socket, sys, time
sys.path.insert(0, sys.argv[3])
from _harness import DROP, hello
from trainmon_client import _protocol as P
exec(DROP)
path, hold, prefix = sys.argv[1], float(sys.argv[2]), sys.argv[4]
end = time.monotonic() + hold
n = failed = 0
while time.monotonic() < end:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(path)
        run = prefix if prefix == "victim" else f"{prefix}{n}"
        s.send(P.packet_header() + hello(run))
        n += 1
    except OSError:
        failed += 1
        time.sleep(0.001)
    finally:
        s.close()
print(n, failed)
"""
"""Short connections as fast as they come: connect, one HELLO (rank 0 of 1 of run
``<prefix><n>``, or of ``victim`` when the prefix is ``victim``), close. Prints
``hellos failed``."""

SQUATTER = """
import socket, sys, time
sys.path.insert(0, sys.argv[3])
from _harness import DROP, hello
from trainmon_client import _protocol as P
exec(DROP)
path, n = sys.argv[1], int(sys.argv[2])
socks = []
for rank in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(path)
        s.send(P.packet_header() + hello("squat", rank, n))
        socks.append(s)
    except OSError:
        s.close()
time.sleep(1.0)
held = 0
for s in socks:
    s.settimeout(0.001)
    try:
        s.recv(16)  # a REFUSED record or end of file: the exporter turned it away
    except TimeoutError:
        held += 1
    except OSError:
        pass
print(held, flush=True)
sys.stdin.readline()
"""
"""``n`` HELLO-only connections (ranks of run ``squat``), held until stdin has a line; prints
how many the exporter kept open (refused ones read a REFUSED record or end of file)."""

SWITCHER = """
import os, socket, sys, time
sys.path.insert(0, sys.argv[5])
from _harness import hello
from trainmon_client import _protocol as P
path, uids, each, hellos = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), sys.argv[4] == "1"
socks = []
for uid in map(int, uids):
    os.setegid(uid)
    os.seteuid(uid)  # the kernel records the effective uid at connect (SO_PEERCRED)
    for i in range(each):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(path)
            if hellos:
                s.send(P.packet_header() + hello(f"squat{uid}", i, each))
            socks.append(s)
        except OSError:
            s.close()
    os.seteuid(0)
    os.setegid(0)
time.sleep(1.0)
print(len(socks), flush=True)
sys.stdin.readline()
told = {}
for s in socks:
    s.setblocking(False)
    try:
        data = s.recv(P.MAX_PACKET_BYTES)
    except BlockingIOError:
        reason = "open"
    except OSError:
        reason = "closed"
    else:
        refusal = P.decode_refused(data) if data else None
        reason = refusal.reason if refusal else "closed"
    told[reason] = told.get(reason, 0) + 1
print(" ".join(f"{k}={v}" for k, v in sorted(told.items())), flush=True)
"""
"""One root process, its effective uid switched to each of ``uids`` in turn: ``each``
connections under each, a HELLO on each (ranks of run ``squat<uid>``) or none; prints how
many it holds, then at a line on stdin what each was told (``open``: still held; a REFUSED
reason; ``closed``)."""

VICTIM = """
import os, sys, time
import trainmon_client
sys.path.insert(0, sys.argv[3])
from _harness import DROP
exec(DROP)
r = trainmon_client.init(run="victim", rank=0, world_size=1, socket_path=sys.argv[1])
for i in range(int(sys.argv[2])):
    r.log(i, loss=1.0, tokens=100)
time.sleep(0.5)
os._exit(0)  # crashes: no finish()
"""

STORM = """
import json, signal, sys, time
import trainmon_client
r = trainmon_client.init(run="storm", rank=0, world_size=1, socket_path=sys.argv[1])
hold = float(sys.argv[2])
n = [0, 0]  # steps logged by the loop, by the handler

def handler(signum, frame):
    n[1] += 1
    r.log(1_000_000 + n[1], loss=2.0)

signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)  # 2 kHz
end = time.monotonic() + hold
while time.monotonic() < end:
    n[0] += 1
    r.log(n[0], loss=1.0, lr=1e-3, tokens=100)
signal.setitimer(signal.ITIMER_REAL, 0, 0)
r.finish()
print(n[0], n[1], r.sent, json.dumps(r.dropped), flush=True)
"""
"""A trainer whose 2 kHz timer signal handler calls ``run.log()`` while the loop logs too."""


def _skip_unless_root(name: str) -> bool:
    if not ROOT:
        print(f"[{name}] skipped: needs root (to run clients as other uids)")
    return not ROOT


def _runs(ex: Exporter) -> dict[str, dict[str, Any]]:
    try:
        status, body = get(ex.port, "/api/v1/runs", timeout=30)
    except OSError:
        return {}
    if status != 200:
        return {}
    return {r["run"]: r for r in json.loads(body)["runs"]}


def hello_churn(hold: float) -> None:
    """The rank table full of live ranks; short connections send new HELLOs flat out."""
    cap = 64
    with Exporter("--max-ranks", str(cap)) as ex:
        live = [raw_connect(ex.socket) for _ in range(cap)]
        for i, s in enumerate(live):
            s.send(P.packet_header() + hello("live", i, cap))
        time.sleep(0.5)
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        ch = subprocess.Popen(
            [sys.executable, "-c", CHURNER, ex.socket, str(hold), _here(), "churn"],
            stdout=subprocess.PIPE,
            text=True,
        )
        hellos, failed = (int(x) for x in ch.communicate(timeout=hold + 60)[0].split())
        dt = time.monotonic() - t0
        prober.stop()
        refused = ex.metric('trainmon_ingest_messages_invalid_total{reason="too_many_ranks"}')
        live_now = len(_runs(ex).get("live", {}).get("ranks", []))
        p50 = prober.p50_ms()
        _report(
            "hello_churn",
            ex,
            prober,
            cpu0,
            t0,
            f"{hellos:,} HELLOs at the rank cap ({cap}) in {dt:.1f} s = {hellos / dt:,.0f}/s "
            f"({failed} connects failed), refused too_many_ranks {refused}; the {cap} live "
            f"ranks kept: {live_now} ({_held(live_now == cap)}); /healthz "
            f"p50 under 100 ms {_held(p50 < 100)}",
        )
        for s in live:
            s.close()


def api_memory(hold: float) -> None:
    """60 requests for /api/v1/runs that are never read: RSS before, during and after."""
    ranks = fd_budget(128 + 60, "api_memory") - 60
    # One uid opens the 128 runs: its rank and series quotas are raised to admit them all.
    quotas = ("--max-ranks-per-uid", "256", "--max-series-per-uid", "50000")
    with Exporter("--http-write-timeout-seconds", str(max(1.0, hold)), *quotas) as ex:
        conns = _fill(ex.socket, ranks, 256)
        time.sleep(1.0)
        size = len(get(ex.port, "/api/v1/runs", timeout=60)[1])
        rss0 = ex.rss_mib()
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        lazy = [_unread(ex.port, "/api/v1/runs") for _ in range(60)]
        time.sleep(max(1.0, hold / 2))
        rss1 = ex.rss_mib()
        time.sleep(max(1.0, hold / 2) + 1.0)  # past the write timeout
        for s in lazy:
            s.close()
        time.sleep(1.0)
        rss2 = ex.rss_mib()
        ok = get(ex.port, "/api/v1/gpus", timeout=10)[0] == 200
        # Read last: a first /metrics of this many series grows the exposition's cache.
        refused = ex.metric('trainmon_http_requests_refused_total{reason="api_limit"}')
        prober.stop()
        bounded = rss1 - rss0 < 100
        back = rss2 - rss0 < max(20.0, 0.25 * (rss1 - rss0))
        _report(
            "api_memory",
            ex,
            prober,
            cpu0,
            t0,
            f"60 unread /api/v1/runs of {size / 1e6:.1f} MB ({ranks} ranks): RSS {rss0:.0f} "
            f"before, {rss1:.0f} during, {rss2:.0f} MiB after; refused api_limit {refused}; "
            f"memory bounded {_held(bounded)}, returned "
            f"{_held(back)}, API answers again {_held(ok)}",
        )
        for c in conns:
            c.close()


def ownership_churn(hold: float) -> None:
    """Another uid makes short connections (new runs, and the victim's run) flat out while the
    victim's rank 0 has crashed: the crashed rank must stay visible and the victim reconnect."""
    if _skip_unless_root("ownership_churn"):
        return
    with Exporter("--max-ranks", "64", shared=True) as ex:
        v = subprocess.Popen(
            [sys.executable, "-c", VICTIM, ex.socket, "20", _here()],
            text=True,
            **as_uid(UID_B),
        )
        v.wait(timeout=60)
        time.sleep(0.5)
        before = _runs(ex).get("victim")
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        churners = [
            subprocess.Popen(
                [sys.executable, "-c", CHURNER, ex.socket, str(hold), _here(), prefix],
                stdout=subprocess.PIPE,
                text=True,
                **as_uid(UID_A),
            )
            for prefix in ("junk", "victim")
        ]
        made = [
            tuple(int(x) for x in c.communicate(timeout=hold + 60)[0].split()) for c in churners
        ]
        prober.stop()
        after = _runs(ex).get("victim")
        owner = after.get("owner_uid") if after else None
        r0 = next((r for r in (after or {}).get("ranks", []) if r["rank"] == 0), None)
        if after is None or r0 is None:
            visible = "NOT held (gone)"
        elif owner != UID_B:
            visible = f"NOT held (the run is now uid {owner}'s)"
        else:
            visible = "held" if r0["status"] == "crashed" else f"NOT held ({r0['status']})"
        tr = _trainer_process(ex.socket, "victim", 50, 0.5, UID_B)
        _sent, dropped = (int(x) for x in tr.communicate(timeout=60)[0].split())
        time.sleep(0.5)
        again = _runs(ex).get("victim") or {}
        rank0 = next((r for r in again.get("ranks", []) if r["rank"] == 0), None)
        back = bool(rank0 and rank0["status"] == "finished" and dropped == 0)
        _report(
            "ownership_churn",
            ex,
            prober,
            cpu0,
            t0,
            f"uid {UID_A} sent {made[0][0]:,} HELLOs of new runs and {made[1][0]:,} for the "
            f"victim's run; the victim's crashed rank (seen before: {before is not None}) still "
            f"shown as the victim's crashed rank: {visible}; the victim reconnected and "
            f"finished: {_held(back)}",
        )


def squat(hold: float) -> None:
    """One uid opens idle HELLO-only connections up to the cap; another uid's trainer must
    still get in."""
    if _skip_unless_root("squat"):
        return
    n = fd_budget(1100, "squat")
    with Exporter(shared=True) as ex:
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        sq = subprocess.Popen(
            [sys.executable, "-c", SQUATTER, ex.socket, str(n), _here()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            **as_uid(UID_A),
        )
        assert sq.stdout is not None and sq.stdin is not None
        held = int(sq.stdout.readline() or 0)
        tr = _trainer_process(ex.socket, "normal", 100, max(1.0, hold), UID_B)
        sent, dropped = (int(x) for x in tr.communicate(timeout=hold + 60)[0].split())
        time.sleep(0.5)
        applied = ex.metric('trainmon_train_steps_total{rank="0",run="normal"}')
        refused = ex.metric('trainmon_ingest_connections_refused_total{reason="uid_quota"}')
        ranks = ex.metric('trainmon_ingest_messages_invalid_total{reason="uid_rank_quota"}')
        sq.communicate("\n", timeout=30)
        prober.stop()
        ok = applied == sent and dropped == 0
        _report(
            "squat",
            ex,
            prober,
            cpu0,
            t0,
            f"uid {UID_A} opened {n} idle connections, {held} kept (refused uid_quota "
            f"{refused}, HELLOs refused uid_rank_quota {ranks}); trainer of uid {UID_B} sent "
            f"{sent}, client-dropped {dropped}, "
            f"exporter applied {applied}: {_held(ok)}",
        )


SQUAT_UIDS = (61011, 61012, 61013, 61014)
"""The four uids the uid-switching squatter takes in turn."""


def _uid_squat(name: str, each: int, hellos: bool, *args: str) -> None:
    """Four uids' worth of idle connections from one process; a fifth uid's 40 steps."""
    if _skip_unless_root(name):
        return
    need = fd_budget(4 * each + 100, name)
    if need < 4 * each + 100:
        print(f"[{name}] skipped: {4 * each + 100} descriptors needed")
        return
    with Exporter(*args, shared=True) as ex:
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        sq = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SWITCHER,
                ex.socket,
                ",".join(map(str, SQUAT_UIDS)),
                str(each),
                "1" if hellos else "0",
                _here(),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert sq.stdout is not None and sq.stdin is not None
        held = int(sq.stdout.readline() or 0)
        ranks0 = ex.metric("trainmon_exporter_ranks ") or 0.0
        tr = _trainer_process(ex.socket, "fair", 40, 1.0, UID_B)
        sent, dropped = (int(x) for x in tr.communicate(timeout=60)[0].split())
        time.sleep(1.5)  # the exporter tells an idle connection it lost its rank within 1 s
        applied = ex.metric('trainmon_train_steps_total{rank="0",run="fair"}') or 0
        holders = {
            uid: ex.metric(f'trainmon_exporter_tenant_ranks{{uid="{uid}"}}')
            for uid in (*SQUAT_UIDS, UID_B)
        }
        idle = ex.metric('trainmon_exporter_ranks_evicted_total{status="idle"}')
        fair = ex.metric('trainmon_ingest_connections_refused_total{reason="fair_share"}')
        full = ex.metric('trainmon_ingest_messages_invalid_total{reason="too_many_ranks"}')
        capped = ex.metric('trainmon_ingest_connections_refused_total{reason="max_connections"}')
        told = sq.communicate("\n", timeout=30)[0].strip()
        prober.stop()
        ok = applied == sent and dropped == 0
        shown = ", ".join(
            f"{uid}: {'–' if n is None else f'{n:.0f}'}" for uid, n in holders.items()
        )
        _report(
            name,
            ex,
            prober,
            cpu0,
            t0,
            f"one process as uids {SQUAT_UIDS[0]}-{SQUAT_UIDS[-1]} holds {held} idle "
            f"connections{' with a HELLO' if hellos else ''} ({ranks0:.0f} ranks); trainer of "
            f"uid {UID_B} sent {sent}, client-dropped {dropped}, exporter applied "
            f"{applied:.0f}: {_held(ok)}; ranks held by uid: {shown}; evicted idle {idle}, "
            f"connections closed fair_share {fair}, refused max_connections {capped}, HELLOs "
            f"refused too_many_ranks {full}; the squatters were told: {told}",
        )


def uid_squat(hold: float) -> None:
    """64 HELLO-only connections under each of four uids fill the rank table."""
    _uid_squat("uid_squat", 64, True)


def uid_squat_connections(hold: float) -> None:
    """256 connections without a HELLO under each of four uids fill the connection slots."""
    _uid_squat("uid_squat_connections", 256, False, "--ingest-hello-timeout-seconds", "60")


def signal_storm(hold: float) -> None:
    """A 2 kHz timer signal whose handler calls run.log() while the loop logs: completes?"""
    limit = max(5.0, 3 * hold + 5)
    with Exporter() as ex:
        p = subprocess.Popen(
            [sys.executable, "-c", STORM, ex.socket, str(hold)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            out, err = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            print(
                f"[signal_storm] NOT held: the trainer did not complete within {limit:.0f} s "
                "(deadlocked in log() from its signal handler); killed"
            )
            return
        if p.returncode != 0 or not out.strip():
            tail = err.strip().splitlines()[-1:] or ["no output"]
            print(f"[signal_storm] NOT held: the trainer failed (exit {p.returncode}): {tail[0]}")
            return
        loop_s, handler_s, sent_s, dropped_s = out.split(maxsplit=3)
        loop, handler, sent = int(loop_s), int(handler_s), int(sent_s)
        dropped: dict[str, int] = json.loads(dropped_s)
        logged = loop + handler
        accounted = sent + sum(dropped.values())
        why = ", ".join(f"{k} {v:,}" for k, v in sorted(dropped.items()) if v) or "none"
        verdict = "held" if accounted >= logged else "NOT held (steps unaccounted for)"
        print(
            f"[signal_storm] {verdict}: completed in time; the loop logged {loop:,} steps and "
            f"the 2 kHz handler {handler:,}; the client sent {sent:,} and dropped ({why}), "
            f"{accounted:,} of {logged:,} accounted for"
        )


EXTREMES = [2.5, -1e308, 1e308, -sys.float_info.max, sys.float_info.max, 5e-324, -5e-324, 2.4]
"""Losses at the ends of the float range, all finite, between two ordinary ones."""
SVG_NUMBER = re.compile(r"\b(?:x1|x2|y1|y2|cx|cy|x|y)='([^']*)'|points='([^']*)'")


def extreme_sparklines(hold: float) -> None:
    """A rank logs the float range's ends: the live view and the page must keep drawing."""
    with Exporter() as ex:
        run = trainmon_client.init(
            run="extremes", rank=0, world_size=1, socket_path=ex.socket, flush_interval=0.0
        )
        for step, loss in enumerate(EXTREMES):
            run.log(step, loss=loss, grad_norm=abs(loss), tokens=1e308)
        run.finish()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "extremes" not in _runs(ex):
            time.sleep(0.05)
        # The live view as a user runs it, refreshed every 0.2 s, then Ctrl-C.
        status = [sys.executable, "-m", "trainmon_exporter", "status"]
        live = subprocess.Popen(
            [*status, "--url", f"127.0.0.1:{ex.port}", "--interval", "0.2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ | {"COLUMNS": "120", "LINES": "60"},
        )
        time.sleep(max(2.0, hold / 4))
        alive = live.poll() is None
        live.send_signal(2)  # SIGINT: how a user leaves the live view
        out, err = live.communicate(timeout=30)
        row = next((ln for ln in out.splitlines() if re.search(r"│ 0/1 +│ [▁-█]", ln)), "")
        _, body = get(ex.port, "/", timeout=10)
        svgs = re.findall(r"<svg.*?</svg>", body.decode(), re.S)
        coords = []
        for svg in svgs:
            for single, points in SVG_NUMBER.findall(svg):
                coords += [single] if single else re.split(r"[ ,]", points)
        bad = [c for c in coords if not re.fullmatch(r"-?\d+(\.\d+)?", c)]
    crashed = "Traceback" in err or not alive or live.returncode != 0
    if crashed:
        last = err.strip().splitlines()[-1] if err.strip() else "no error printed"
        what = f"trainmon status failed (exit {live.returncode}: {last})"
    else:
        what = "trainmon status drew every refresh and left on Ctrl-C (exit 0)"
    print(
        f"[extreme_sparklines] {_held(not crashed and bool(row))}: {what}; the loss sparkline "
        f"row it showed at 120 columns: {row.strip() or '(none drawn)'}"
    )
    print(
        f"[extreme_sparklines] {_held(not bad and bool(coords))}: the status page drew "
        f"{len(svgs)} sparklines at {len(coords)} coordinates, {len(bad)} not a finite number"
        + (f" (e.g. {bad[0]!r})" if bad else "")
    )


ATTACKS = {
    "idle": idle,
    "http": http_half,
    "flood": flood,
    "multi_flood": multi_flood,
    "scrapes": scrapes,
    "never_read": never_read,
    "series": series,
    "hello_churn": hello_churn,
    "api_memory": api_memory,
    "ownership_churn": ownership_churn,
    "squat": squat,
    "uid_squat": uid_squat,
    "uid_squat_connections": uid_squat_connections,
    "signal_storm": signal_storm,
    "extreme_sparklines": extreme_sparklines,
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("attacks", nargs="*", help=" ".join(ATTACKS))
    ap.add_argument("--hold", type=float, default=8.0)
    ap.add_argument("--smoke", action="store_true", help="seconds: every attack held 0.3 s")
    args = ap.parse_args()
    if args.smoke:
        args.hold = 0.3
    for name in args.attacks or list(ATTACKS):
        ATTACKS[name](args.hold)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
