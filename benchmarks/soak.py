"""Soak: many ranks for a bounded time while Prometheus-like scrapes run; nothing lost unseen.

A real exporter subprocess (``python -m trainmon_exporter``) and ``--ranks`` real clients
(``trainmon_client.init``, one process, world size ``--ranks``), each training its own small
torch MLP (4 linear layers, SGD) with ``Run.watch(every=10, activations=True)``, logging at
``--rate`` steps/s: loss, lr, grad norm, tokens, samples, allocated memory and four custom
metrics per step. A scraper GETs ``/metrics`` every second throughout.

Printed at the end:

- records the clients logged and sent, and dropped by reason (client side);
- records the exporter applied (``trainmon_ingest_messages_total`` for step and layers), those
  it reports sent but never applied (``trainmon_ingest_messages_unapplied_total``) and its
  invalid records; **unexplained** = sent - applied - counted (must be 0);
- exporter RSS at the start, the end, and its least-squares slope (MiB/min) over the second
  half of the run (after the windows fill), and at the end of each minute (a run of 10
  minutes or more shows whether a growth levels off);
- ``/metrics`` p50 / p99 / max latency (ms) and size;
- exporter CPU seconds per 1,000 records applied (psutil user + system).

    python benchmarks/soak.py [--ranks 64] [--rate 10] [--seconds 120]
    python benchmarks/soak.py --smoke       # 8 ranks, 8 s: runs in CI, figures not judged
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch
from _harness import Exporter, get, slope_per_minute

import trainmon_client

CUSTOM = ("data_wait_seconds", "moe_aux_loss", "tokens_dropped", "attn_entropy")
APPLIED_TYPES = ("step", "layers", "eval", "track", "checkpoint")


class Scraper(threading.Thread):
    """GET /metrics every ``interval`` s; keeps latencies (s) and the last body's size."""

    def __init__(self, port: int, interval: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.port, self.interval = port, interval
        self.lat: list[float] = []
        self.failures = 0
        self.size = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            t0 = time.perf_counter()
            try:
                status, body = get(self.port, "/metrics", timeout=10)
            except OSError:
                self.failures += 1
                continue
            self.lat.append(time.perf_counter() - t0)
            if status != 200:
                self.failures += 1
            self.size = len(body)

    def stop(self) -> Scraper:
        self._halt.set()
        self.join()
        return self


def by_label(ex: Exporter, family: str) -> dict[str, float]:
    """``{label text: value}`` of every sample of ``family`` (a counter's ``_total``)."""
    _, body = get(ex.port, "/metrics", timeout=30)
    out = {}
    for line in body.decode().splitlines():
        if line.startswith(family + "{"):
            labels, value = line[len(family) + 1 :].rsplit("} ", 1)
            out[labels] = float(value)
    return out


def scrape_sum(ex: Exporter, prefix: str) -> float:
    value = ex.metric(prefix)
    return 0.0 if value is None else value


class Rank:
    """One rank: its client, model, optimizer and watcher."""

    def __init__(self, rank: int, world: int, socket_path: str) -> None:
        torch.manual_seed(rank)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(32, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 32),
            torch.nn.ReLU(),
            torch.nn.Linear(32, 1),
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        self.run = trainmon_client.init(
            run="soak",
            rank=rank,
            local_rank=rank % 8,
            world_size=world,
            socket_path=socket_path,
        )
        self.watcher = self.run.watch(
            self.model, self.opt, every=10, quantiles_every=50, activations=True
        )
        self.x = torch.randn(16, 32)
        self.y = torch.randn(16, 1)

    def step(self, step: int) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1e9)
        self.opt.step()
        self.run.log(
            step,
            loss=loss.item(),
            lr=1e-2,
            grad_norm=float(gn),
            tokens=2048,
            samples=16,
            mem_allocated=1e9 + 1e3 * (step % 17),
            **{name: 0.01 * (i + 1) * (1 + step % 5) for i, name in enumerate(CUSTOM)},
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--rate", type=float, default=10.0, help="steps/s per rank")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--smoke", action="store_true", help="8 ranks, 8 s (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.ranks, args.seconds = 8, 8.0
    torch.set_num_threads(1)

    with Exporter() as ex:
        ranks = [Rank(r, args.ranks, ex.socket) for r in range(args.ranks)]
        scraper = Scraper(ex.port)
        scraper.start()
        rss: list[tuple[float, float]] = []
        cpu0, rss0 = ex.cpu_seconds(), ex.rss_mib()
        t0 = time.monotonic()
        next_rss = 0.0
        step = 0
        late = 0
        period = 1.0 / args.rate
        while (now := time.monotonic() - t0) < args.seconds:
            for r in ranks:
                r.step(step)
            step += 1
            if now >= next_rss:
                rss.append((now, ex.rss_mib()))
                next_rss += 2.0
            sleep = t0 + step * period - time.monotonic()
            if sleep > 0:
                time.sleep(sleep)
            else:
                late += 1
        elapsed = time.monotonic() - t0
        for r in ranks:
            r.watcher.remove()
            r.run.finish()
        time.sleep(1.5)  # a scrape interval for the last records to be read
        scraper.stop()
        cpu = ex.cpu_seconds() - cpu0
        rss1 = ex.rss_mib()

        sent = sum(r.run.sent for r in ranks)
        drops: dict[str, int] = {}
        for r in ranks:
            for k, v in r.run.dropped.items():
                drops[k] = drops.get(k, 0) + v
        applied = sum(
            scrape_sum(ex, f'trainmon_ingest_messages_total{{type="{t}"}}') for t in APPLIED_TYPES
        )
        unapplied = scrape_sum(ex, "trainmon_ingest_messages_unapplied_total")
        invalid = scrape_sum(ex, "trainmon_ingest_messages_invalid_total")
        dropped_values = {
            k: v for k, v in by_label(ex, "trainmon_ingest_values_dropped_total").items() if v
        }
        counted = unapplied  # the exporter's own account of what it did not apply
        unexplained = int(sent - applied - counted)

    half = [p for p in rss if p[0] >= args.seconds / 2]
    lat = sorted(scraper.lat)
    q = (
        statistics.quantiles(lat, n=100, method="inclusive")
        if len(lat) >= 2
        else [lat[0] if lat else 0.0] * 99
    )
    achieved = step / elapsed
    print(
        f"{args.ranks} ranks x {step} steps in {elapsed:.0f} s ({achieved:.1f} steps/s per rank, "
        f"goal {args.rate:g}; {late} ticks late), watch every 10 steps, "
        f"{len(CUSTOM)} custom metrics, /metrics scraped every 1 s",
        flush=True,
    )
    print(
        f"client   sent {sent:,} records; dropped: "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(drops.items()))
    )
    print(
        f"exporter applied {int(applied):,} (step, layers, eval, track, checkpoint); "
        f"unapplied {int(unapplied):,}; invalid records {int(invalid):,}; "
        "values dropped inside applied records: "
        + (", ".join(f"{k} {int(v):,}" for k, v in dropped_values.items()) or "none")
    )
    print(f"unexplained drops: {unexplained:,} (sent - applied - unapplied; goal 0)")
    print(
        f"exporter RSS {rss0:.1f} -> {rss1:.1f} MiB; slope over the second half "
        f"{slope_per_minute(half):+.2f} MiB/min"
    )
    minutes = [
        next(v for t, v in reversed(rss) if t <= m * 60) for m in range(1, int(elapsed // 60) + 1)
    ]
    if minutes:
        print(
            "exporter RSS at the end of each minute (MiB): "
            + ", ".join(f"{v:.1f}" for v in minutes)
        )
    print(
        f"/metrics: {len(lat)} scrapes, {scraper.failures} failed, "
        f"p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms, max "
        f"{(lat[-1] if lat else 0.0) * 1e3:.1f} ms, {scraper.size / 1024:.0f} KiB"
    )
    per_k = 1000.0 * cpu / applied if applied else float("nan")
    print(
        f"exporter CPU {cpu:.1f} s in all, {per_k * 1e3:.1f} ms per 1,000 records applied "
        f"({100 * cpu / elapsed:.1f} % of one core)"
    )
    return 0 if unexplained == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
