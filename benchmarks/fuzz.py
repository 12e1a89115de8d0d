"""Fuzz the wire decoder, ingest (record application, close, scrape) and a rank's analytics.

The properties of ``tests/exporter/test_fuzz.py`` with many more examples (hypothesis, random
seeds), for a bounded time each. Any exception other than ``ProtocolError`` out of the decoder,
any exception out of ingest or a scrape, or any record ingest had to drop as
``internal_error`` is a failure: it is printed with the falsifying example and the exit status
is 1.

    python benchmarks/fuzz.py              # 60 s per property
    python benchmarks/fuzz.py --seconds 600
    python benchmarks/fuzz.py --smoke      # a few seconds (make bench, CI)

Prints, per property: examples run, packets (or events) applied, records decoded, and the
rate, e.g. ``ingest  12,345 connections  50,123 packets  0 internal errors  310/s``.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.helpers.fuzzing import (  # noqa: E402
    Target,
    decode_all,
    floats,
    layer_rows,
    new_state,
    packets,
    raw_packets,
    step_heads_and_fields,
)
from trainmon_client import _protocol as P  # noqa: E402

BATCH = 200
"""Examples per hypothesis run (each from a fresh seed)."""


def run(name: str, seconds: float, body: Any, strategy: Any) -> dict[str, Any]:
    """Run ``body`` on examples of ``strategy`` until ``seconds`` pass; returns the figures.

    Batches of :data:`BATCH` examples, each batch from a new random seed, until time is up.
    """
    stats: dict[str, Any] = {"examples": 0, "units": 0}

    def once(example: Any) -> None:
        stats["units"] += body(example)
        stats["examples"] += 1

    t0 = time.monotonic()
    failure = None
    while failure is None and time.monotonic() - t0 < seconds:
        prop = settings(
            max_examples=BATCH,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        )(seed(random.getrandbits(64))(given(strategy)(once)))
        try:
            prop()
        except Exception as exc:  # a real finding: hypothesis printed the falsifying example
            failure = f"{type(exc).__name__}: {exc}"
    stats["seconds"] = time.monotonic() - t0
    stats["failure"] = failure
    print(
        f"{name:<10} {stats['examples']:>9,} examples {stats['units']:>10,} units "
        f"{stats['examples'] / max(stats['seconds'], 1e-9):>8,.0f}/s  "
        + ("OK" if failure is None else f"FAILED {failure}"),
        flush=True,
    )
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="time per property (s)")
    ap.add_argument("--smoke", action="store_true", help="2 s per property")
    args = ap.parse_args()
    seconds = 2.0 if args.smoke else args.seconds
    logging.disable(logging.CRITICAL)  # refusals log warnings by design; the counters count
    target = Target()

    def decode(packet: bytes) -> int:
        return decode_all(packet)

    def ingest(data: st.DataObject) -> int:
        pkts = data.draw(packets(target.next_run()))
        before = target.packets
        target.apply(pkts)
        if target.internal_errors():
            raise AssertionError(f"{target.internal_errors():.0f} records raised in ingest")
        return target.packets - before

    def raw(pkts: list[bytes]) -> int:
        target.apply(pkts)
        if target.internal_errors():
            raise AssertionError(f"{target.internal_errors():.0f} records raised in ingest")
        return len(pkts)

    def apply(events: list[Any]) -> int:
        state = new_state()
        for ev in events:
            if isinstance(ev, float):
                state.analytics.observe_eval(ev)
            elif isinstance(ev, list):
                state.analytics.observe_layers([(f"l{i}", r) for i, r in enumerate(ev)])
            else:
                head, fields = ev
                ids = tuple(f for f, _ in fields)
                values = tuple(v for _, v in fields)
                state.observe_step(P.Step(P.StepHeader(*head), ids, values), {}, 60.0)
        a = state.analytics
        a.ema_slope(), a.plateau(), a.throughput_ratio(), a.eval_gap(), a.check_memory()
        return len(events)

    print(f"fuzz: {seconds:g} s per property; units = records decoded, packets or events applied")
    results = [
        run("decoder", seconds, decode, raw_packets),
        run("ingest", seconds, ingest, st.data()),
        run("raw", seconds, raw, st.lists(raw_packets, min_size=1, max_size=4)),
        run(
            "analytics",
            seconds,
            apply,
            st.lists(st.one_of(step_heads_and_fields, layer_rows, floats), max_size=80),
        ),
    ]
    total = sum(r["examples"] for r in results)
    packets_applied = target.packets
    print(f"total: {total:,} examples, {packets_applied:,} packets through ingest and a scrape")
    return 1 if any(r["failure"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
