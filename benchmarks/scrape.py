"""The /metrics scrape at a realistic node size: 8 ranks, each watching a 128-layer model, 8 GPUs.

A real exporter process samples 8 scripted H100s through the fake ``libnvidia-ml.so.1`` of
``tests/fakes/libnvml`` (compiled here with gcc); 8 real trainer processes (the client, with
``Run.watch()`` on a 128-layer MLP every 10th step) log at ``--rate`` steps/s each (the
trainers sleep between steps, as a GPU-bound trainer's CPU thread does). Once every
rank's layers are in, ``/metrics`` is fetched over HTTP (what Prometheus does) ``--scrapes``
times while the ranks keep logging, and the same is done for ``/healthz`` as the HTTP floor of
the same run. Two exporter settings are measured:

- the default ``--layer-ranks 0``: per-layer series for rank 0 only (ranks of one data-parallel
  job see the same layers, so the other ranks' layer series repeat rank 0's);
- ``--layer-ranks all``: every rank's layers (8 x 128 layers), the worst case a user can ask for.

    python benchmarks/scrape.py [--scrapes 50 --rate 10]
    python benchmarks/scrape.py --smoke      # seconds: 2 ranks, 8 layers, a few scrapes

Prints, per setting: the exposition's lines and bytes, then p50 / p99 / max milliseconds of a
``/metrics`` request and of a ``/healthz`` request (goal: ``/metrics`` p50 under 20 ms).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.libnvml import CONFIG_ENV, build, h100, write_config  # noqa: E402
from trainmon_exporter.local import LocalExporter  # noqa: E402

TRAINER = """
import sys, time, torch, trainmon_client
layers, rate, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
run = trainmon_client.init(run="scrape-bench")
run.watch(model, opt, every=10, quantiles_every=100, budget=1.0, max_layers=layers)
x = torch.randn(4, 16)
t0 = time.monotonic()
step = 0
while time.monotonic() - t0 < seconds:
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    run.log(step, loss=loss.item(), lr=1e-3, tokens=64, samples=4)
    step += 1
    time.sleep(max(0.0, t0 + step / rate - time.monotonic()))
run.finish()
"""


def fetch_ms(url: str) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
    return (time.perf_counter() - t0) * 1e3, body


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def formatting(body: bytes, repeats: int) -> str:
    """Same-process, same-data formatting cost: prometheus-client's ``generate_latest`` against
    the exporter's :class:`TextExposition` (second and later renders, as at every scrape after
    the first), alternating, on the families parsed back from a real exposition."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from trainmon_exporter.exposition import TextExposition

    class Frozen:
        def __init__(self) -> None:
            self.families = list(text_string_to_metric_families(body.decode()))

        def collect(self) -> list[object]:
            return self.families

    registry = CollectorRegistry()
    registry.register(Frozen())  # type: ignore[arg-type]
    text = TextExposition()
    same = text.render(registry) == generate_latest(registry)
    lib: list[float] = []
    ours: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate_latest(registry)
        t1 = time.perf_counter()
        text.render(registry)
        t2 = time.perf_counter()
        lib.append((t1 - t0) * 1e3)
        ours.append((t2 - t1) * 1e3)
    a, b = statistics.median(lib), statistics.median(ours)
    return (
        f"formatting only, median of {repeats}: generate_latest {a:.2f} ms, TextExposition "
        f"{b:.2f} ms ({b / a:.2f}x), output identical: {same}"
    )


def measure(
    label: str, flags: list[str], ranks: int, layers: int, rate: float, scrapes: int
) -> None:
    seconds = 30.0 + scrapes * 0.3
    with LocalExporter(*flags) as ex:
        env = {**os.environ, "TRAINMON_SOCKET": ex.socket, "WORLD_SIZE": str(ranks)}
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", TRAINER, str(layers), str(rate), str(seconds)],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stderr=subprocess.DEVNULL,  # the KeyboardInterrupt that stops them
            )
            for r in range(ranks)
        ]
        try:
            want = ranks if "all" in flags else 1
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # every rank up, every watched rank's layers in
                body = fetch_ms(ex.url + "/metrics")[1].decode()
                up = sum(1 for ln in body.splitlines() if ln.startswith("trainmon_rank_info{"))
                layered = {
                    ln.split('rank="', 1)[1].split('"', 1)[0]
                    for ln in body.splitlines()
                    if ln.startswith("trainmon_layer_grad_norm{") and 'rank="' in ln
                }
                if up >= ranks and len(layered) >= want:
                    break
                time.sleep(0.5)
            else:
                raise RuntimeError(f"{label}: ranks or layers did not arrive in time")
            metrics: list[float] = []
            health: list[float] = []
            size = lines = 0
            for _ in range(scrapes):
                ms, body_b = fetch_ms(ex.url + "/metrics")
                metrics.append(ms)
                size, lines = len(body_b), body_b.count(b"\n")
                health.append(fetch_ms(ex.url + "/healthz")[0])
                time.sleep(0.2)
        finally:
            for p in procs:
                p.send_signal(signal.SIGINT)  # KeyboardInterrupt: finish(failed=True)
            for p in procs:
                p.wait(30)
    print(
        f"{label:34s} {lines:7d} {size / 1e3:8.0f} "
        f"{pct(metrics, 0.5):8.1f} {pct(metrics, 0.99):8.1f} {max(metrics):8.1f}   "
        f"{pct(health, 0.5):6.1f} {pct(health, 0.99):6.1f} (mean {statistics.mean(metrics):.1f})"
    )
    print(f"{'':34s} {formatting(body_b, max(5, scrapes))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--layers", type=int, default=128)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rate", type=float, default=10.0, help="steps/s per rank")
    ap.add_argument("--scrapes", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="seconds: 2 ranks, 8 layers, 3 scrapes")
    args = ap.parse_args()
    if args.smoke:
        args.ranks, args.layers, args.gpus, args.scrapes = 2, 8, 2, 3
    tmp = Path(tempfile.mkdtemp(prefix="tm-scrape-"))
    lib = build(tmp)
    cfg = tmp / "gpus.conf"
    write_config(cfg, [h100(i, procs=f"{1000 + i}:{2**30}") for i in range(args.gpus)])
    os.environ["LD_LIBRARY_PATH"] = f"{lib.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"
    os.environ[CONFIG_ENV] = str(cfg)
    print(
        f"{args.ranks} ranks x {args.layers} watched layers at {args.rate:g} steps/s, "
        f"{args.gpus} fake GPUs (R570); {args.scrapes} scrapes over HTTP; "
        f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}"
    )
    print(
        f"{'exporter setting':34s} {'lines':>7s} {'kB':>8s} {'p50 ms':>8s} {'p99 ms':>8s} "
        f"{'max ms':>8s}   {'/healthz p50 / p99 ms':>14s}"
    )
    for label, flags in (
        ("--layer-ranks 0 (default)", []),
        ("--layer-ranks all", ["--layer-ranks", "all"]),
    ):
        measure(label, flags, args.ranks, args.layers, args.rate, args.scrapes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
