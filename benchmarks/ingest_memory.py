"""Exporter memory under the soak's load, long enough to see whether it levels off.

The exporter's own ingest (``IngestServer.handle_packet``), collectors and detector clock, in
this process, on a clock that steps 0.1 s a tick, so that a quarter of an hour of ``--ranks``
ranks at 10 steps/s runs in less wall time than it simulates. Each rank's steps carry loss,
lr, grad norm, tokens, samples, allocated memory and 4 custom metrics, a watch check of 4
layers every 10 steps (as ``benchmarks/soak.py``'s trainers), the detectors judge every tick and
``/metrics`` is rendered every 15 s (a Prometheus scrape interval). 15 simulated minutes of
64 ranks took 5 to 11 minutes on a shared 2-core machine.

Printed: the process's RSS at the end of every simulated minute, its least-squares slope
(MiB/min) over the second half, and with ``--trace`` the ten source lines whose live memory
grew most between the first minute and the end (``tracemalloc``, which slows the run about
threefold).

    python benchmarks/ingest_memory.py [--ranks 64] [--minutes 15] [--trace]
    python benchmarks/ingest_memory.py --smoke    # 8 ranks, 2 minutes (CI; figures not judged)
"""

from __future__ import annotations

import argparse
import gc
import math
import socket
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from unittest import mock

from _harness import slope_per_minute

from trainmon_client import _protocol as P
from trainmon_exporter import Settings
from trainmon_exporter.app import build_exporter
from trainmon_exporter.exposition import TextExposition
from trainmon_exporter.ingest import Connection
from trainmon_exporter.shed import SampleBudget

CUSTOM = ("data_wait_seconds", "moe_aux_loss", "tokens_dropped", "attn_entropy")
LAYERS = ("0", "2", "4", "6")


class Clock:
    """``time.time`` and ``time.monotonic`` that move 0.1 s a tick, and only then."""

    def __init__(self) -> None:
        self.wall, self.mono = 1.7e9, 10_000.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=15.0, help="simulated minutes")
    ap.add_argument("--trace", action="store_true", help="tracemalloc: what grew most")
    ap.add_argument("--smoke", action="store_true", help="8 ranks, 2 minutes (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.ranks, args.minutes = 8, 2.0
    clock = Clock()
    with (
        mock.patch.object(time, "time", clock.time),
        mock.patch.object(time, "monotonic", clock.monotonic),
    ):
        settings = Settings(socket=Path(tempfile.mkdtemp(prefix="tm-mem-")) / "t.sock")
        ex = build_exporter(settings)
        pairs = [
            socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(args.ranks)
        ]
        conns = []
        for r, (a, _) in enumerate(pairs):
            conn = Connection(a)
            conn.peer_pid, conn.peer_uid, conn.peer_gid = 5000 + r, 1000, 1000
            conns.append(conn)
            fields = {
                "run": "soak",
                "rank": r,
                "local_rank": r % 8,
                "world_size": args.ranks,
                "hostname": "node",
                "pid": 5000 + r,
                "client_version": "benchmark",
                "gpu_uuid": None,
                "started_at": clock.wall,
                "flops_per_token": None,
                "dtype": "bf16",
            }
            names = [P.encode_name(64 + i, n) for i, n in enumerate(CUSTOM + LAYERS)]
            ex.ingest.handle_packet(
                conn, P.packet_header() + P.encode_hello(fields) + b"".join(names)
            )
        std = P.STANDARD_FIELDS
        ids = [std["loss"], std["lr"], std["grad_norm"], std["mem_allocated"], 64, 65, 66, 67]
        layer_ids = [64 + len(CUSTOM) + i for i in range(len(LAYERS))]
        stats = [P.LAYER_STATS["grad_norm"], P.LAYER_STATS["update_ratio"]]
        if args.trace:
            tracemalloc.start(1)
        minutes: list[tuple[float, float]] = []
        first = None
        ticks = int(args.minutes * 600)
        t0 = time.perf_counter()
        for tick in range(1, ticks + 1):
            for r, conn in enumerate(conns):
                values = [1.0 + 0.01 * math.sin(tick + r), 1e-2, 1.0 + 0.1 * math.cos(tick)]
                values += [1e9 + 1e3 * (tick % 17)]
                values += [0.01 * (i + 1) * (1 + tick % 5) for i in range(len(CUSTOM))]
                head = P.STEP_HEADER.pack(
                    tick, tick, clock.wall, 0.1, 2048.0 * tick, 16.0 * tick, 1e-4 * tick, 0, 0, 0
                )
                records = [P.encode_fields(P.STEP, head, ids, values)]
                if tick % 10 == 0:
                    records.append(
                        P.encode_layers(
                            tick, clock.wall, tick // 10, 0.0, layer_ids, stats, [0.5, 1e-3] * 4
                        )
                    )
                ex.ingest.handle_packet(conn, P.packet_header() + b"".join(records))
            clock.wall += 0.1
            clock.mono += 0.1
            ex.store.check_conditions()
            if tick % 150 == 0:  # 15 s: a scrape
                TextExposition().render(SampleBudget(ex.registry, settings.scrape_sample_limit))
            if tick % 600 == 0:
                gc.collect()
                minutes.append((tick / 10, rss_mib()))
                if args.trace and first is None:
                    first = tracemalloc.take_snapshot()
        elapsed = time.perf_counter() - t0
        last = tracemalloc.take_snapshot() if args.trace else None
    for a, _ in pairs:
        a.close()
    print(
        f"{args.ranks} ranks x {ticks:,} steps (10 steps/s, {args.minutes:g} simulated minutes) "
        f"in {elapsed:.0f} s; /metrics rendered every 15 s"
    )
    print("RSS at the end of each minute (MiB): " + ", ".join(f"{v:.1f}" for _, v in minutes))
    half = [p for p in minutes if p[0] >= args.minutes * 30]
    print(f"RSS slope over the second half: {slope_per_minute(half):+.2f} MiB/min")
    if first is not None and last is not None:
        print("grew most from the first minute to the end (tracemalloc):")
        for stat in last.compare_to(first, "lineno")[:10]:
            print(f"  {stat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
