"""False alarms of the shipped alert rules on clean training runs, evaluated by Prometheus.

    python benchmarks/detection/false_alarms.py [--runs 3 --steps 2000 --watch 10]
    python benchmarks/detection/false_alarms.py --smoke   # one 100-step run (CI)

A real exporter; Debian's Prometheus scraping it every second and evaluating the shipped
rule files (``deploy/prometheus/trainmon.rules.yml`` and ``trainmon.alerts.yml``) every
second; ``--runs`` clean runs of ``scenario.py`` (the example's byte transformer on real text,
nothing injected), one after the other, then ``--example-steps`` of the example trainer
(``examples/train_char_transformer.py``: evaluations every 100 steps, checkpoints, a cosine
schedule), each watched with ``Run.watch(every=--watch)`` so the per-layer alerts are judged
too. Afterwards every ``ALERTS`` series Prometheus produced is
read back (``max_over_time`` over the whole run), Watchdog aside.

Prints, per alert that was pending or firing on a clean run: the runs it fired on, and the
rate per 1,000 clean steps. Alerts with a ``for:`` longer than the runs can only be pending
here; they are listed as such. Then the detector counters that were not zero at the end
(loss spikes by severity, gradient-gain drifts, throughput drops, ...): what the dashboards
mark without an alert, and the ranks the hang rules named suspects at any evaluation
(``rank:trainmon_hang_suspect:info``, docs/hangs.md; a clean run has no hang, so none). Exits
1 when any alert fired or any rank was named.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from trainmon_exporter.local import LocalExporter, free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RULES = ROOT / "deploy" / "prometheus"
SCENARIO = HERE / "scenario.py"
EXAMPLE = ROOT / "examples" / "train_char_transformer.py"


def query(base: str, q: str) -> list[dict[str, object]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())["data"]["result"]  # type: ignore[no-any-return]


def start_prometheus(tmp: Path, target: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port(0)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES / "trainmon.rules.yml"), str(RULES / "trainmon.alerts.yml")],
        "scrape_configs": [{"job_name": "trainmon", "static_configs": [{"targets": [target]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=(tmp / "prometheus.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if query(base, 'up{job="trainmon"} == 1'):
                return proc, base
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("Prometheus did not scrape the exporter within 30 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--watch", type=int, default=10, help="Run.watch every N steps (0: off)")
    ap.add_argument(
        "--example-steps",
        type=int,
        default=1500,
        help="then the example trainer for this many steps (evaluations, checkpoints; 0: off)",
    )
    ap.add_argument("--smoke", action="store_true", help="one 100-step run (CI)")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.steps, args.example_steps = 1, 100, 30
    if shutil.which("prometheus") is None:
        print("prometheus not installed (Debian package prometheus): nothing measured")
        return 0 if args.smoke else 1

    tmp = Path(tempfile.mkdtemp(prefix="tm-fa-"))
    ex = LocalExporter().start()
    prom = None
    try:
        prom, base = start_prometheus(tmp, f"127.0.0.1:{ex.port}")
        t0 = time.time()
        stamp = int(t0)
        runs = [
            [
                str(SCENARIO),
                "--scenario",
                "clean",
                "--run",
                f"clean-{stamp}-{seed}",
                "--seed",
                str(seed),
                "--steps",
                str(args.steps),
                "--watch",
                str(args.watch),
            ]
            for seed in range(args.runs)
        ]
        if args.example_steps:
            runs.append(
                [
                    str(EXAMPLE),
                    "--run",
                    f"example-{stamp}",
                    "--steps",
                    str(args.example_steps),
                    "--watch",
                    str(args.watch),
                ]
            )
        for cmd in runs:
            subprocess.run(
                [sys.executable, *cmd],
                env={**os.environ, "TRAINMON_SOCKET": ex.socket},
                stdout=subprocess.DEVNULL,
                check=True,
            )
        time.sleep(5)  # scrapes and evaluations of the last steps
        span = int(time.time() - t0) + 5
        alerts = query(base, f'max_over_time(ALERTS{{alertname!="Watchdog"}}[{span}s])')
        # The hang evidence: a rank named a suspect at any evaluation (docs/hangs.md).
        suspects = query(base, f"max_over_time(rank:trainmon_hang_suspect:info[{span}s])")
        events = detector_events(ex.get("/metrics").decode())
        rules = {
            r["name"]: r
            for g in query_rules(base)
            for r in g["rules"]
            if r.get("type") == "alerting"
        }
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        ex.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    steps = args.runs * args.steps + args.example_steps
    seen: dict[tuple[str, str], set[str]] = {}
    for a in alerts:
        m = a["metric"]
        assert isinstance(m, dict)
        seen.setdefault((m["alertname"], m["alertstate"]), set()).add(
            f"{m.get('run', '')}/{m.get('rank', '')}"
        )
    print(
        f"clean runs: {args.runs} x {args.steps} steps of the small scenario model and "
        f"{args.example_steps} of the example trainer (Run.watch every {args.watch}), "
        f"{len(rules)} alert rules evaluated every 1 s"
    )
    fired = 0
    for (name, state), where in sorted(seen.items()):
        if state == "firing" or (name, "firing") not in seen:
            n = len(where)
            fired += state == "firing"
            rate = 1000.0 * n / steps
            print(
                f"  {name:<32s} {state:<8s} on {n} run/rank(s), {rate:.2f} per 1,000 steps "
                f"(for: {rules.get(name, {}).get('duration', '?')} s)"
            )
    if not seen:
        print("  no alert pending or firing")
    print("detector events on the same runs (counters; they alert only where a rule says so):")
    counted = {k: n for k, n in sorted(events.items()) if n > 0}
    for (name, labels), n in counted.items():
        label = f"{name}{{{labels}}}" if labels else name
        print(f"  {label:<58s} {n:5.0f}  {1000.0 * n / steps:.2f} per 1,000 steps")
    if not counted:
        print("  none")
    named = sorted(
        {f"{m['run']}/{m['rank']} in {m['frame']}" for a in suspects for m in [a["metric"]]}  # type: ignore[index]
    )
    print(f"hang suspects named (rank:trainmon_hang_suspect:info): {', '.join(named) or 'none'}")
    return 1 if (fired or named) and not args.smoke else 0


EVENT_COUNTERS = (
    "trainmon_train_loss_spikes_total",
    "trainmon_train_grad_norm_spikes_total",
    "trainmon_train_grad_explosions_total",
    "trainmon_train_grad_gain_drifts_total",
    "trainmon_train_update_ratio_high_total",
    "trainmon_train_throughput_drops_total",
    "trainmon_train_hangs_total",
    "trainmon_train_memory_leaks_total",
    "trainmon_train_nonfinite_values_total",
    "trainmon_hang_capture_requests_total",
)


def detector_events(exposition: str) -> dict[tuple[str, str], float]:
    """Detector counters summed over runs and ranks, per name and severity (or field)."""
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(exposition):
        for s in fam.samples:
            if s.name in EVENT_COUNTERS:
                label = ",".join(
                    f'{k}="{s.labels[k]}"' for k in ("severity", "field") if k in s.labels
                )
                key = (s.name, label)
                out[key] = out.get(key, 0.0) + s.value
    return out


def query_rules(base: str) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10) as r:
        return json.loads(r.read())["data"]["groups"]  # type: ignore[no-any-return]


if __name__ == "__main__":
    sys.exit(main())
