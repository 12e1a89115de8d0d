"""In-situ cost of ``Run.log()`` with 10 scalars, against ten ``prometheus_client`` Gauge.set.

Both are timed inside a real training loop (the example's byte transformer on stdlib text),
right after ``optimizer.step()``, where caches are cold, alternating step by step (ABAB) so
both see the same conditions. A real exporter listens on the socket, so flushes really send.
For reference it also times a naive design: ``json.dumps`` + one Unix datagram per step, and
``Run.log()`` of a step whose batch came through ``Run.timed()`` (it adds ``data_time``), and
the cost ``Run.timed()`` adds to each item of a loop.

    python benchmarks/client_log.py [--steps 1500]

Prints p50 / p90 / p99 / max in microseconds and the p50 and p99 ratios against the Gauge.set
baseline of the same run (goal: p50 at most 0.5x, p99 at most 1.0x).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Gauge

import trainmon_client
from trainmon_exporter.local import LocalExporter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from train_char_transformer import ByteTransformer, load_corpus, train_step  # noqa: E402

NAMES = ("loss", "lr", "grad_norm", "tokens", "samples", "m1", "m2", "m3", "m4", "m5")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument(
        "--event-driven",
        action="store_true",
        help="exporter reads each packet as it arrives (--ingest-poll-interval-seconds 0), "
        "so every flush wakes it: the design this project rejected",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="seconds: 40 steps (figures not meaningful)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.steps = 40
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="tm-bench-"))
    extra = ["--ingest-poll-interval-seconds", "0"] if args.event_driven else []
    exporter = LocalExporter(*extra).start()
    try:
        data = load_corpus(1_000_000)
        model = ByteTransformer(128, 2, 4, 128)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = trainmon_client.init(run="bench", socket_path=exporter.socket)
        reg = CollectorRegistry()
        gauges = [Gauge(f"bench_{n}", n, registry=reg) for n in NAMES]
        dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        dgram_path = tmp / "d.sock"
        sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sink.bind(str(dgram_path))
        sink.setblocking(False)
        B, T = 16, 128
        t_log: list[float] = []
        t_gauge: list[float] = []
        t_naive: list[float] = []
        t_timed: list[float] = []
        batches = run.timed(iter(int, 1))  # an endless iterable: each item is a "batch"
        step_times: list[float] = []
        prev = time.perf_counter()
        for step in range(args.steps):
            loss, gn = train_step(model, opt, data, B, T)
            lv, gv = loss.item(), gn.item()
            vals = (lv, 1e-3, gv, B * T, B, 0.1, 0.2, 0.3, 0.4, 0.5)
            which = step % 4
            if which == 3:
                next(batches)  # outside the timing: the wait timed() measures
            t0 = time.perf_counter()
            if which == 0 or which == 3:
                run.log(
                    step,
                    loss=lv,
                    lr=1e-3,
                    grad_norm=gv,
                    tokens=B * T,
                    samples=B,
                    m1=0.1,
                    m2=0.2,
                    m3=0.3,
                    m4=0.4,
                    m5=0.5,
                )
                (t_log if which == 0 else t_timed).append(time.perf_counter() - t0)
            elif which == 1:
                for g, v in zip(gauges, vals, strict=True):
                    g.set(v)
                t_gauge.append(time.perf_counter() - t0)
            else:
                msg = json.dumps({"step": step, **dict(zip(NAMES, vals, strict=True))})
                try:
                    dgram.sendto(msg.encode(), str(dgram_path))
                except OSError:
                    pass
                t_naive.append(time.perf_counter() - t0)
                try:
                    while True:
                        sink.recv(65536)
                except BlockingIOError:
                    pass
            now = time.perf_counter()
            step_times.append(now - prev)
            prev = now
        run.finish()
        skip = min(30, len(t_log) // 4)  # warm-up
        t_log, t_gauge, t_naive = t_log[skip:], t_gauge[skip:], t_naive[skip:]
        t_timed = t_timed[skip:]
        items = list(range(200_000))
        t_plain = t_wrapped = math.inf
        for _ in range(5):  # best of 5: the per-item cost of timed() in a tight loop
            t0 = time.perf_counter()
            for _item in items:
                pass
            t_plain = min(t_plain, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _item in run.timed(items):
                pass
            t_wrapped = min(t_wrapped, time.perf_counter() - t0)
        print(
            f"in-situ timing over {args.steps} real training steps "
            f"(median step {pct(step_times, 0.5) / 1e3:.1f} ms), torch threads "
            f"{torch.get_num_threads()}, {os.cpu_count()} CPUs"
        )
        print(f"{'call':44s} {'p50 us':>8s} {'p90 us':>8s} {'p99 us':>8s} {'max us':>9s}")
        rows = [
            ("trainmon Run.log(), 10 scalars", t_log),
            ("baseline: 10 x prometheus_client Gauge.set", t_gauge),
            ("naive: json.dumps + one datagram per step", t_naive),
            ("trainmon Run.log(), 10 scalars + timed()", t_timed),
        ]
        for name, xs in rows:
            print(
                f"{name:44s} {pct(xs, 0.5):8.1f} {pct(xs, 0.9):8.1f} {pct(xs, 0.99):8.1f} "
                f"{max(xs) * 1e6:9.1f}"
            )
        ratio = pct(t_log, 0.5) / pct(t_gauge, 0.5)
        print(
            f"p50 ratio log()/baseline: {ratio:.2f}x (goal <= 0.5x); "
            f"p99 ratio {pct(t_log, 0.99) / pct(t_gauge, 0.99):.2f}x (goal <= 1.0x); "
            f"dropped {sum(run.dropped.values())}"
        )
        print(
            f"Run.timed(): {(t_wrapped - t_plain) / len(items) * 1e6:.3f} us per item over a "
            f"plain for loop ({len(items)} items, best of 5)"
        )
        return 0
    finally:
        exporter.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
