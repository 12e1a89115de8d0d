"""trainmon side by side with the tools users would pick instead, on the same machine and steps.

Every tool logs the same 10 scalars (loss, lr, grad norm, tokens, samples and five others)
every step of the example training loop (the byte transformer on stdlib text, CPU). Each tool
runs in a fresh worker process; repetitions are interleaved and the order rotates, so drift
(thermal, other load) spreads over all tools. Inside each worker:

- **in situ**: every call is timed right after ``optimizer.step()``, where caches are cold;
- **training overhead**: ABBA blocks of steps, A logging every step and B not logging at all,
  (A - B) / B per round. The ``none`` tool is the A/A control: its A blocks do not log either,
  which shows the method's own noise;
- **helper CPU**: CPU seconds used by processes other than the trainer during the measured
  steps: the trainer's descendants (wandb-core, ...) and the services the benchmark started
  (the trainmon exporter, the Pushgateway), so work moved out of process is not hidden;
- **RSS**: the trainer's resident memory after the tool is set up, minus before (``init``),
  and its growth over the measured steps.

Tools (each is optional; one that is not installed is listed and skipped): ``trainmon``
(a real exporter listens), ``prometheus_client`` (10 in-process ``Gauge.set``: the
baseline), ``wandb`` (offline), ``tensorboard`` (``torch.utils.tensorboard`` ``add_scalar``
x 10), ``mlflow`` (local file store; ``mlflow-async`` with ``synchronous=False``),
``pushgateway`` (one ``push_to_gateway`` per step to Debian's ``prometheus-pushgateway``
started on 127.0.0.1), ``otel`` (OpenTelemetry SDK gauges, in-process aggregation, a periodic
exporter every second writing to /dev/null).

    python benchmarks/peers.py [--reps 3 --rounds 4 --block 20] [--tools trainmon,wandb]
    python benchmarks/peers.py --smoke      # seconds: a tiny model, every tool once

Prints one table: p50 / p90 / p99 / max microseconds per call, overhead % +- 2 standard
errors, helper CPU ms per step, RSS MB; and the in-situ ratios of trainmon against the
``prometheus_client`` baseline of the same run (goal: p50 <= 0.5x, p99 <= 1.0x).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOOLS = (
    "none",
    "trainmon",
    "prometheus_client",
    "wandb",
    "tensorboard",
    "mlflow",
    "mlflow-async",
    "pushgateway",
    "otel",
)
REQUIRES = {  # distribution whose version is reported (and whose absence skips the tool)
    "trainmon": "trainmon-client",
    "prometheus_client": "prometheus-client",
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "mlflow": "mlflow-skinny",
    "mlflow-async": "mlflow-skinny",
    "pushgateway": "prometheus-client",
    "otel": "opentelemetry-sdk",
}
NAMES = ("loss", "lr", "grad_norm", "tokens", "samples", "m1", "m2", "m3", "m4", "m5")
CUSTOM = (0.1, 0.2, 0.3, 0.4, 0.5)
PUSHGATEWAY = shutil.which("prometheus-pushgateway") or shutil.which("pushgateway")
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- measurements


def cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` in seconds (0 when it is gone).

    The sum over its live threads of ``/proc/PID/task/TID/schedstat``'s first field (time on
    CPU, nanoseconds): ``/proc/PID/stat``'s utime + stime count in clock ticks (10 ms), far too
    coarse for a service that spends tens of microseconds per step. Falls back to ticks where
    schedstat is missing.
    """
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
        if total:
            return total / 1e9
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (walks ``/proc/*/stat`` parent links)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents[int(entry.name)] = ppid
    out: list[int] = []
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        frontier += kids
    return out


def rss_mb() -> float:
    """This process's resident set size (MB, ``VmRSS``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ----------------------------------------------------------------------------- the tools


Log = Callable[[int, tuple[float, ...]], None]


@contextlib.contextmanager
def open_tool(tool: str, tmp: Path, env: dict[str, str]) -> Iterator[Log]:
    """Set ``tool`` up in this process and yield its per-step logging call."""
    if tool == "none":
        yield lambda step, vals: None
    elif tool == "trainmon":
        import trainmon_client

        run = trainmon_client.init(run="peers", socket_path=env["TRAINMON_SOCKET"])

        def log_trainmon(step: int, v: tuple[float, ...]) -> None:
            run.log(
                step,
                loss=v[0],
                lr=v[1],
                grad_norm=v[2],
                tokens=v[3],
                samples=v[4],
                m1=v[5],
                m2=v[6],
                m3=v[7],
                m4=v[8],
                m5=v[9],
            )

        yield log_trainmon
        run.finish()
        if sum(run.dropped.values()):
            print(f"trainmon dropped {run.dropped}", file=sys.stderr)
    elif tool in ("prometheus_client", "pushgateway"):
        from prometheus_client import CollectorRegistry, Gauge, push_to_gateway

        reg = CollectorRegistry()
        gauges = [Gauge(f"peers_{n}", n, registry=reg) for n in NAMES]
        if tool == "prometheus_client":

            def log_gauges(step: int, v: tuple[float, ...]) -> None:
                for g, x in zip(gauges, v, strict=True):
                    g.set(x)

            yield log_gauges
        else:
            gateway = env["PUSHGATEWAY"]

            def log_push(step: int, v: tuple[float, ...]) -> None:
                for g, x in zip(gauges, v, strict=True):
                    g.set(x)
                push_to_gateway(gateway, job="peers", registry=reg)

            yield log_push
    elif tool == "wandb":
        import wandb

        run = wandb.init(project="peers", mode="offline", dir=str(tmp))

        def log_wandb(step: int, v: tuple[float, ...]) -> None:
            run.log(dict(zip(NAMES, v, strict=True)), step=step)

        yield log_wandb
        run.finish()
    elif tool == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(tmp / "tb"))

        def log_tb(step: int, v: tuple[float, ...]) -> None:
            for n, x in zip(NAMES, v, strict=True):
                writer.add_scalar(n, x, step)

        yield log_tb
        writer.close()
    elif tool in ("mlflow", "mlflow-async"):
        import mlflow

        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # the local file store, as documented
        mlflow.set_tracking_uri((tmp / "mlruns").as_uri())
        mlflow.start_run()
        sync = tool == "mlflow"

        def log_mlflow(step: int, v: tuple[float, ...]) -> None:
            mlflow.log_metrics(dict(zip(NAMES, v, strict=True)), step=step, synchronous=sync)

        yield log_mlflow
        mlflow.end_run()
    elif tool == "otel":
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import (
            ConsoleMetricExporter,
            PeriodicExportingMetricReader,
        )

        sink = open(os.devnull, "w")  # noqa: SIM115
        reader = PeriodicExportingMetricReader(
            ConsoleMetricExporter(out=sink), export_interval_millis=1000
        )
        provider = MeterProvider(metric_readers=[reader])
        meter = provider.get_meter("peers")
        gauges = [meter.create_gauge(n) for n in NAMES]

        def log_otel(step: int, v: tuple[float, ...]) -> None:
            for g, x in zip(gauges, v, strict=True):
                g.set(x)

        yield log_otel
        provider.shutdown()
        sink.close()
    else:
        raise ValueError(f"unknown tool {tool!r}")


# ----------------------------------------------------------------------------- one worker


def worker(args: argparse.Namespace) -> int:
    """Train with one tool; print one JSON line of raw figures."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from train_char_transformer import ByteTransformer, load_corpus, train_step

    torch.manual_seed(0)
    dim, layers = (32, 1) if args.smoke else (128, 2)
    bsz, seq = (4, 32) if args.smoke else (16, 128)
    data = load_corpus(200_000 if args.smoke else 1_000_000)
    model = ByteTransformer(dim, layers, 4, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    helpers = [int(p) for p in args.helper_pids.split(",") if p]
    tmp = Path(tempfile.mkdtemp(prefix="tm-peers-"))
    env = dict(os.environ)
    control = args.worker == "none"
    rss0 = rss_mb()
    try:
        with open_tool(args.worker, tmp, env) as log:
            rss_init = rss_mb() - rss0
            step = 0
            in_situ: list[float] = []

            def block(arm_a: bool) -> float:
                nonlocal step
                t0 = time.perf_counter()
                for _ in range(args.block):
                    loss, gn = train_step(model, opt, data, bsz, seq)
                    if arm_a:
                        vals = (loss.item(), 1e-3, gn.item(), bsz * seq, bsz, *CUSTOM)
                        t = time.perf_counter()
                        log(step, vals)
                        in_situ.append(time.perf_counter() - t)
                    else:
                        loss.item(), gn.item()  # the same host reads as arm A
                    step += 1
                return (time.perf_counter() - t0) / args.block

            block(True)  # warm-up: connect, caches, lazy imports
            block(False)
            in_situ.clear()
            me = os.getpid()
            others = descendants(me) + helpers
            cpu0 = {p: cpu_seconds(p) for p in others}
            rss1 = rss_mb()
            overheads: list[float] = []
            a_steps = 0
            for _ in range(args.rounds):
                a1, b1, b2, a2 = block(True), block(False), block(False), block(True)
                overheads.append(((a1 + a2) - (b1 + b2)) / (b1 + b2))
                a_steps += 2 * args.block
            # helpers started during the run (e.g. a lazily spawned service) count from 0
            others = set(others) | set(descendants(me))
            helper_cpu = sum(cpu_seconds(p) - cpu0.get(p, 0.0) for p in others)
            rss_growth = rss_mb() - rss1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if control:
        in_situ = [0.0]
    print(
        json.dumps(
            {
                "tool": args.worker,
                "in_situ_s": in_situ,
                "overheads": overheads,
                "helper_cpu_s_per_step": helper_cpu / a_steps,
                "rss_init_mb": rss_init,
                "rss_growth_mb": rss_growth,
            }
        )
    )
    return 0


# ----------------------------------------------------------------------------- orchestration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def available(tool: str) -> str | None:
    """The tool's version, or None when it cannot run here."""
    if tool == "none":
        return "-"
    if tool == "pushgateway" and PUSHGATEWAY is None:
        return None
    try:
        version = importlib.metadata.version(REQUIRES[tool])
    except importlib.metadata.PackageNotFoundError:
        return None
    if tool == "pushgateway":
        out = subprocess.run([PUSHGATEWAY, "--version"], capture_output=True, text=True)
        first = (out.stdout or out.stderr).splitlines()[:1]
        version += f", gateway {first[0].split()[2] if first else '?'}"
    return version


@contextlib.contextmanager
def services(tools: list[str]) -> Iterator[tuple[dict[str, str], dict[str, int]]]:
    """Start the trainmon exporter and the Pushgateway when a tool needs them.

    Yields the environment the workers need and, per tool, the pid of the service that tool
    talks to: a service's CPU time is charged to its own tool only (the exporter to
    ``trainmon``, the gateway to ``pushgateway``), never to the others running beside it.
    """
    env: dict[str, str] = {}
    pids: dict[str, int] = {}
    stack = contextlib.ExitStack()
    with stack:
        if "trainmon" in tools:
            from trainmon_exporter.local import LocalExporter

            ex = stack.enter_context(LocalExporter())
            assert ex.proc is not None
            env["TRAINMON_SOCKET"] = ex.socket
            pids["trainmon"] = ex.proc.pid
        if "pushgateway" in tools:
            assert PUSHGATEWAY is not None
            port = free_port()
            gw = subprocess.Popen(
                [PUSHGATEWAY, f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            stack.callback(gw.wait)
            stack.callback(gw.terminate)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                time.sleep(0.1)
            env["PUSHGATEWAY"] = f"127.0.0.1:{port}"
            pids["pushgateway"] = gw.pid
        yield env, pids


def summarise(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for tool, runs in results.items():
        xs = [x for r in runs for x in r["in_situ_s"]]
        ovh = [o for r in runs for o in r["overheads"]]
        table[tool] = {
            "p50": pct(xs, 0.5) * 1e6,
            "p90": pct(xs, 0.9) * 1e6,
            "p99": pct(xs, 0.99) * 1e6,
            "max": max(xs) * 1e6,
            "calls": len(xs),
            "overhead": statistics.mean(ovh) * 100,
            "se2": 2 * statistics.stdev(ovh) / len(ovh) ** 0.5 * 100 if len(ovh) > 1 else 0.0,
            "helper_ms": statistics.mean(r["helper_cpu_s_per_step"] for r in runs) * 1e3,
            "rss_init": statistics.mean(r["rss_init_mb"] for r in runs),
            "rss_growth": statistics.mean(r["rss_growth_mb"] for r in runs),
        }
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset")
    ap.add_argument("--reps", type=int, default=3, help="worker processes per tool")
    ap.add_argument("--rounds", type=int, default=4, help="ABBA rounds per worker")
    ap.add_argument("--block", type=int, default=20, help="steps per ABBA block")
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny model, one rep")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--helper-pids", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.reps, args.rounds, args.block = 1, 2, 3
    if args.worker:
        return worker(args)
    wanted = [t for t in args.tools.split(",") if t]
    unknown = sorted(set(wanted) - set(TOOLS))
    if unknown:
        ap.error(f"unknown tools {unknown}; known: {', '.join(TOOLS)}")
    versions = {t: available(t) for t in wanted}
    tools = [t for t in wanted if versions[t] is not None]
    for t in wanted:
        if versions[t] is None:
            print(f"skipped {t}: not installed here")
    results: dict[str, list[dict[str, Any]]] = {t: [] for t in tools}
    with services(tools) as (env, pids):
        for rep in range(args.reps):
            order = tools[rep % len(tools) :] + tools[: rep % len(tools)]
            for tool in order:
                cmd = [sys.executable, __file__, "--worker", tool]
                cmd += ["--rounds", str(args.rounds), "--block", str(args.block)]
                if tool in pids:
                    cmd += ["--helper-pids", str(pids[tool])]
                if args.smoke:
                    cmd.append("--smoke")
                out = subprocess.run(
                    cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=900
                )
                if out.returncode != 0:
                    print(out.stdout, out.stderr, sep="\n", file=sys.stderr)
                    print(f"{tool}: worker failed with exit code {out.returncode}")
                    return 1
                results[tool].append(json.loads(out.stdout.strip().splitlines()[-1]))
    table = summarise(results)
    print(
        f"{args.reps} worker(s) per tool x {args.rounds} ABBA rounds x 4 blocks x {args.block} "
        f"steps; {os.cpu_count()} CPUs, Python {sys.version.split()[0]}"
    )
    head = (
        f"{'tool':18s} {'version':24s} {'p50 us':>8s} {'p90 us':>8s} {'p99 us':>8s} "
        f"{'max us':>9s} {'overhead %':>16s} {'helper ms/step':>15s} {'RSS init/growth MB':>19s}"
    )
    print(head)
    for tool in tools:
        r = table[tool]
        print(
            f"{tool:18s} {versions[tool] or '':24.24s} {r['p50']:8.1f} {r['p90']:8.1f} "
            f"{r['p99']:8.1f} {r['max']:9.1f} {r['overhead']:+7.2f} +- {r['se2']:5.2f} "
            f"{r['helper_ms']:15.3f} {r['rss_init']:9.1f} / {r['rss_growth']:6.1f}"
        )
    if "trainmon" in table and "prometheus_client" in table:
        t, b = table["trainmon"], table["prometheus_client"]
        print(
            f"trainmon / prometheus_client in situ: p50 {t['p50'] / b['p50']:.2f}x "
            f"(goal <= 0.5x), p99 {t['p99'] / b['p99']:.2f}x (goal <= 1.0x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
