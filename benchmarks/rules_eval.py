"""Rule evaluation cost of the shipped Prometheus rules on a 64-rank synthetic load.

    python benchmarks/rules_eval.py [--ranks 64 --seconds 40]

One process drives ``--ranks`` real clients (one Run per rank, world size = ranks) at 10 steps/s
each, against a real exporter. Debian's Prometheus scrapes it every second and evaluates
``deploy/prometheus/*.rules.yml`` and ``*.alerts.yml`` every second. Prints Prometheus's own
``prometheus_rule_group_last_duration_seconds`` per group, the slowest rules (``evaluationTime``
of ``/api/v1/rules``), and the exporter's scrape duration and series count.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml
from _harness import start_prometheus

import trainmon_client
from trainmon_exporter.local import LocalExporter, free_port

ROOT = Path(__file__).resolve().parents[1]


def query(base: str, q: str) -> list[dict[str, object]]:
    url = f"{base}/api/v1/query?query={urllib.parse.quote(q)}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["data"]["result"]  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="seconds: 2 ranks, a few evaluations (figures not meaningful)",
    )
    args = ap.parse_args()
    if args.smoke:
        args.ranks, args.seconds = 2, 8.0
    if shutil.which("prometheus") is None:
        raise SystemExit("needs Debian's prometheus package")
    tmp = Path(tempfile.mkdtemp(prefix="tm-rules-"))
    with LocalExporter() as ex:
        port = free_port()
        prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        prom["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        prom["rule_files"] = [str(ROOT / "deploy/prometheus" / f) for f in prom["rule_files"]]
        prom.pop("alerting")
        prom["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{ex.port}"]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom))
        proc, log = start_prometheus(tmp, port)
        base = f"http://127.0.0.1:{port}"
        try:
            runs = [
                trainmon_client.init(
                    run="synthetic-64",
                    rank=r,
                    local_rank=r % 8,
                    world_size=args.ranks,
                    socket_path=ex.socket,
                )
                for r in range(args.ranks)
            ]
            t0 = time.time()
            step = 0
            while time.time() - t0 < args.seconds:
                for r in runs:
                    r.log(
                        step,
                        loss=2.0 + 0.01 * (step % 7),
                        lr=3e-4,
                        grad_norm=0.8,
                        tokens=4096,
                        samples=8,
                        mem_allocated=2e9,
                    )
                step += 1
                time.sleep(0.1)
            with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
                own = r.read().decode()  # Prometheus's own metrics (it does not scrape itself)
            series = query(base, 'scrape_samples_scraped{job="trainmon"}')
            scrape = query(base, 'scrape_duration_seconds{job="trainmon"}')
            print(f"{args.ranks} ranks x {step} steps at 10 steps/s, 1 s scrape and evaluation:")
            for line in own.splitlines():
                if line.startswith(
                    ("prometheus_rule_group_last_duration_seconds{", "prometheus_rule_group_rules{")
                ):
                    name, value = line.rsplit(" ", 1)
                    group = name.split('rule_group="', 1)[1].split('"', 1)[0].rsplit(";", 1)[-1]
                    what = "rules" if "group_rules" in name else "last evaluation (ms)"
                    v = float(value) * (1e3 if "duration" in name else 1)
                    print(f"  rule group {group:18s} {what:22s} {v:8.2f}")
            if series and scrape:
                print(
                    f"  exporter scrape: {float(scrape[0]['value'][1]) * 1e3:.1f} ms for "  # type: ignore[index]
                    f"{int(float(series[0]['value'][1]))} samples"
                )  # type: ignore[index]
            with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=5) as r:
                groups = json.load(r)["data"]["groups"]
            rules = [(x["evaluationTime"], x["name"]) for g in groups for x in g["rules"]]
            print("  slowest rules, last evaluation (ms), from /api/v1/rules:")
            for seconds, name in sorted(rules, reverse=True)[:6]:
                print(f"    {name:38s} {seconds * 1e3:8.2f}")
            for r in runs:
                r.finish()
        finally:
            proc.terminate()
            proc.wait(10)
            log.close()
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
