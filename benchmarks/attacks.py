"""The exporter under hostile load: what it holds, and how fast /healthz and /metrics answer.

Each attack runs against a fresh exporter subprocess while a prober GETs ``/healthz`` every
50 ms on a new connection (as a kubelet would):

- ``idle``: 1,100 Unix connections that never send a byte, exporter limited to 1,024 open
  files; then a real trainer connects and logs 20 steps.
- ``http``: 1,000 TCP connections that send half an HTTP request and stop.
- ``flood``: one connection sends valid STEP packets as fast as it can while a real trainer
  logs 100 steps/s; how many of the trainer's steps the exporter applied.
- ``scrapes``: 64 ranks with 256 custom metrics each; 4 threads read ``/metrics`` in a loop
  and 4 connections request it without reading the answer, while a trainer logs 100 steps/s.
- ``series``: one client within every per-rank cap (256 runs x (256 custom metrics + 128
  layers)) plus 100,000 ``Run.track`` operation names: exposition size, scrape time, RSS.

    python benchmarks/attacks.py [idle http flood scrapes series] [--hold 8]
    python benchmarks/attacks.py --smoke   # every attack held 0.3 s (figures not meaningful)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

from _harness import Exporter, Prober, get, hello, latency_summary, raw_connect, step_records

import trainmon_client
from trainmon_client import _protocol as P

FLOODER = """
import socket, sys, time
sys.path.insert(0, sys.argv[3])
from _harness import hello, step_records, raw_connect
from trainmon_client import _protocol as P
s = raw_connect(sys.argv[1], timeout=None)
s.send(P.packet_header() + hello("flood"))
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


def _report(name: str, ex: Exporter, prober: Prober, cpu0: float, t0: float, extra: str) -> None:
    dt = time.monotonic() - t0
    cpu = (ex.cpu_seconds() - cpu0) / dt * 100
    print(f"[{name}] /healthz {prober.summary()}")
    print(
        f"[{name}] exporter CPU {cpu:.0f} % of a core, log {ex.log_lines:,} lines "
        f"({ex.log_bytes / 1e6:.2f} MB), RSS {ex.rss_mib():.0f} MiB; {extra}"
    )


def idle(hold: float) -> None:
    with Exporter(nofile=1024) as ex:
        prober = Prober(ex.port)
        prober.start()
        cpu0, t0 = ex.cpu_seconds(), time.monotonic()
        socks = []
        refused = 0
        for _ in range(1100):
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
        for _ in range(1000):
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
    with Exporter() as ex:
        conns = _fill(ex.socket, 64, 256)
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
        lazy = []
        for _ in range(4):
            s = socket.create_connection(("127.0.0.1", ex.port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            lazy.append(s)
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
            # /metrics may answer 503 while the readers hold the concurrent-scrape slots
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


def series(hold: float) -> None:
    with Exporter() as ex:
        rss0 = ex.rss_mib()
        t = time.perf_counter()
        conns = _fill(ex.socket, 256, 256, layers=128)
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


ATTACKS = {"idle": idle, "http": http_half, "flood": flood, "scrapes": scrapes, "series": series}


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
