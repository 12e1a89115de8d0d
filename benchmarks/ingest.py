"""Exporter ingest: sustained steps/s from 8 concurrent ranks, drops, and cost per step.

Part 1 (in process): the cost of applying one STEP record (decode + per-rank state update)
through ``IngestServer.handle_packet``, in microseconds per step; the budget for the
analytics is 20 us per step per rank.

Part 2 (real processes): 8 client processes log as fast as they can for ``--seconds`` through
the real client against a real exporter, then at a fixed rate of ``--rate`` steps/s each.
Prints what the exporter applied per second and what the clients dropped.

    python benchmarks/ingest.py [--seconds 5 --rate 1000] [--smoke]

``--smoke`` runs every part briefly (seconds; the figures mean nothing) so CI keeps it working.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from trainmon_client import _protocol as P
from trainmon_exporter.ingest import Connection, IngestMetrics, IngestServer
from trainmon_exporter.local import LocalExporter
from trainmon_exporter.state.store import Store

SENDER = """
import sys, time, trainmon_client
seconds, rate = float(sys.argv[1]), float(sys.argv[2])
run = trainmon_client.init(run="ingest-bench")
i, t0 = 0, time.perf_counter()
period = 1.0 / rate if rate > 0 else 0.0
while (now := time.perf_counter()) - t0 < seconds:
    run.log(i, loss=1.0, lr=1e-3, grad_norm=0.5, tokens=4096, samples=8,
            m1=0.1, m2=0.2, m3=0.3, m4=0.4, m5=0.5)
    i += 1
    if period:
        delay = t0 + i * period - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
run.finish()
d = run.dropped
print(i, d["disconnected"], d["backpressure"])
"""


def per_step_cost(n_steps: int = 50_000) -> float:
    """Microseconds to apply one 10-field STEP record, batched 100 per packet."""
    store = Store(max_ranks=16, max_custom_metrics=64, buckets=(0.1, 1.0), window_s=30, ttl_s=60)
    server = IngestServer(Path("/unused"), store, IngestMetrics(CollectorRegistry()))
    # A real connected socket, so the connection carries this process's real credentials
    # (SO_PEERCRED) exactly as a trainer's would; packets are handed to the server directly.
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn = Connection(here)
    hello = {k: None for k in P.HELLO_FIELDS} | {
        "run": "b",
        "rank": 0,
        "local_rank": 0,
        "world_size": 1,
        "hostname": "h",
        "pid": 1,
        "client_version": "x",
        "started_at": 0.0,
        "dtype": "bf16",
    }
    names = b"".join(P.encode_name(64 + i, f"m{i}") for i in range(5))
    server.handle_packet(conn, P.packet_header() + P.encode_hello(hello) + names)
    if conn.state is None:
        raise RuntimeError("the exporter refused the benchmark's HELLO (see its log above)")
    s = P.step_struct(8)
    packets = []
    for p in range(n_steps // 100):
        recs = b"".join(
            s.pack(
                P.STEP,
                P.step_payload_length(8),
                i,
                i + 1,
                1000.0 + i * 0.01,
                0.01,
                4096.0 * i,
                8.0 * i,
                0.0,
                0,
                0,
                0,
                1,
                2,
                3,
                64,
                65,
                66,
                67,
                68,
                1.0,
                1e-3,
                0.5,
                0.1,
                0.2,
                0.3,
                0.4,
                0.5,
            )
            for i in range(p * 100, p * 100 + 100)
        )
        packets.append(P.packet_header() + recs)
    t0 = time.perf_counter()
    for pkt in packets:
        server.handle_packet(conn, pkt)
    dt = time.perf_counter() - t0
    here.close()
    there.close()
    applied = store.ranks[("b", 0)].steps_total
    if applied != n_steps:
        raise RuntimeError(f"the exporter applied {applied} of {n_steps} steps")
    return dt / n_steps * 1e6


def fleet(exporter: LocalExporter, seconds: float, rate: float) -> None:
    before = _applied(exporter)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SENDER, str(seconds), str(rate)],
            env={
                "TRAINMON_SOCKET": exporter.socket,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "8",
                "PATH": "/usr/bin:/bin",
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(8)
    ]
    sent = dropped_disc = dropped_bp = 0
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 60)
        n, dd, db = (int(x) for x in out.split())
        sent, dropped_disc, dropped_bp = sent + n, dropped_disc + dd, dropped_bp + db
    time.sleep(0.5)
    applied = _applied(exporter) - before
    label = "as fast as possible" if rate <= 0 else f"{rate:,.0f} steps/s per rank"
    print(
        f"  8 ranks, {label}: sent {sent:,} steps in {seconds:.0f} s; exporter applied "
        f"{applied:,.0f} ({applied / seconds:,.0f} steps/s); client drops: backpressure "
        f"{dropped_bp:,}, disconnected {dropped_disc:,}"
    )


def _applied(exporter: LocalExporter) -> float:
    for line in exporter.get("/metrics").decode().splitlines():
        if line.startswith('trainmon_ingest_messages_total{type="step"}'):
            return float(line.split()[-1])
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument(
        "--smoke", action="store_true", help="seconds: every part, tiny (figures not meaningful)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.seconds = 0.3
    cost = per_step_cost(2_000 if args.smoke else 50_000)
    print(f"exporter cost per step (decode + state update, 10 fields): {cost:.2f} us")
    with LocalExporter() as exporter:
        fleet(exporter, args.seconds, 0.0)
        fleet(exporter, args.seconds, args.rate)
        rss = next(
            float(ln.split()[-1])
            for ln in exporter.get("/metrics").decode().splitlines()
            if ln.startswith("process_resident_memory_bytes")
        )
        print(f"  exporter resident memory after the runs: {rss / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
