"""What the time accounting costs the exporter: ingest and scrape, side by side with a baseline.

    python benchmarks/goodput_cost.py --baseline DIR [--ranks 64 --rounds 6]
    python benchmarks/goodput_cost.py --smoke

``DIR`` is a checkout of another version of this repository (e.g. ``git worktree add DIR
main``): its ``client/src`` and ``exporter/src`` are put first on ``PYTHONPATH`` for the
baseline's runs. Each round runs this checkout and the baseline one after the other, each in
a fresh process, so both share the machine's load as it is then. A run builds a store of
``--ranks`` ranks of one run, applies 200 steps of six fields (data_time among them) to
each, then measures:

- **ingest**: the cost of applying one STEP (``Store.observe_step``: the rank's figures,
  analytics and time accounting), median over 30 rounds of a step for every rank, in us;
- **scrape**: rendering ``/metrics`` for that store (every collector but the GPU ones, and the
  exporter's own text exposition), median of 30 renders, in ms.

Both in CPU time of the measuring thread (``time.thread_time``): a scrape lets other threads
run between chunks of ranks (``time.sleep(0)``), and on a shared machine the wall time of
that depends on everyone else's load, not on this code.

Prints each run's figures, then the medians and this checkout's ratio to the baseline's.
Without ``--baseline`` it measures this checkout alone.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS = 200


def probe(ranks: int) -> None:
    """One measurement in this process (``--probe``): prints ``ingest_us scrape_ms lines``."""
    from prometheus_client import CollectorRegistry

    from trainmon_client import _protocol as P
    from trainmon_exporter.collectors import CollectorContext, ScrapeCollector, build_collectors
    from trainmon_exporter.exposition import TextExposition
    from trainmon_exporter.settings import Settings
    from trainmon_exporter.state.store import Store

    store = Store(
        max_ranks=4096,
        max_custom_metrics=256,
        buckets=(0.1, 1.0, 10.0),
        window_s=30,
        ttl_s=600,
        max_series=5_000_000,
    )
    names = {64: "m1", 65: "m2"}

    def drop(reason: str, n: int) -> None:
        pass

    hello = {
        "run": "cost",
        "local_rank": 0,
        "world_size": ranks,
        "hostname": "h",
        "pid": 1,
        "client_version": "x",
        "gpu_uuid": None,
        "flops_per_token": None,
        "dtype": "bf16",
        "started_at": time.time(),
    }
    states = [store.attach({**hello, "rank": r}, uid=1000, pid=10 + r) for r in range(ranks)]
    ids = (P.FIELD_LOSS, P.FIELD_LR, P.FIELD_GRAD_NORM, P.FIELD_DATA_TIME, 64, 65)

    def step(n: int) -> P.Step:
        head = P.StepHeader(n, n, time.time(), 0.1, 4096.0 * n, 8.0 * n, 0.0, 0, 0, 0)
        return P.Step(head, ids, (1.0 / n, 1e-3, 0.5, 0.01, 0.1, 0.2))

    for n in range(1, STEPS + 1):
        for s in states:
            store.observe_step(s, step(n), names, drop)  # type: ignore[arg-type]
    ingest = []
    for n in range(STEPS + 1, STEPS + 31):
        records = [step(n) for _ in states]
        t0 = time.thread_time()
        with store.lock:
            for s, rec in zip(states, records, strict=True):
                store.observe_step(s, rec, names, drop)  # type: ignore[arg-type]
        ingest.append((time.thread_time() - t0) / ranks * 1e6)
    settings = Settings(
        socket=Path("/nonexistent/cost.sock"), collectors={"gpu": False, "rank_gpu": False}
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeCollector(build_collectors(CollectorContext(settings, store))))  # type: ignore[arg-type]
    text = TextExposition()
    body = text.render(registry)
    scrape = []
    for _ in range(30):
        t0 = time.thread_time()
        body = text.render(registry)
        scrape.append((time.thread_time() - t0) * 1e3)
    lines = body.count(b"\n")
    print(f"{statistics.median(ingest):.3f} {statistics.median(scrape):.3f} {lines}")


def run(baseline: Path | None, ranks: int) -> tuple[float, float, int]:
    env = dict(os.environ)
    if baseline is not None:
        env["PYTHONPATH"] = f"{baseline / 'client' / 'src'}:{baseline / 'exporter' / 'src'}"
    else:
        env.pop("PYTHONPATH", None)
    out = subprocess.run(
        [sys.executable, __file__, "--probe", "--ranks", str(ranks)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout.split()
    return float(out[0]), float(out[1]), int(out[2])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, help="a checkout of the version to compare with")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="seconds: 4 ranks, one round")
    args = ap.parse_args()
    if args.probe:
        probe(args.ranks)
        return 0
    if args.smoke:
        args.ranks, args.rounds = 4, 1
    sides: dict[str, list[tuple[float, float, int]]] = {"this": [], "baseline": []}
    for i in range(args.rounds):
        for side in ("this", "baseline") if args.baseline else ("this",):
            got = run(args.baseline if side == "baseline" else None, args.ranks)
            sides[side].append(got)
            load = os.getloadavg()[0]
            print(
                f"round {i + 1} {side:8s}: ingest {got[0]:7.2f} us/step   scrape {got[1]:7.2f} ms"
                f"   {got[2]} lines   (load {load:.1f})",
                flush=True,
            )
    for side, runs in sides.items():
        if runs:
            ing = statistics.median(r[0] for r in runs)
            scr = statistics.median(r[1] for r in runs)
            each = f"ingest {ing:.2f} us/step, scrape {scr:.2f} ms"
            print(f"{side:8s} median: {each} ({args.ranks} ranks)")
    if sides["baseline"]:
        ratio = [
            statistics.median(r[k] for r in sides["this"])
            / statistics.median(r[k] for r in sides["baseline"])
            for k in (0, 1)
        ]
        print(f"this / baseline: ingest {ratio[0]:.3f}, scrape {ratio[1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
