"""Memory of a Prometheus per head series of trainmon's rank series (the ones job turnover renews).

    python benchmarks/prometheus_memory.py [--small 20 --large 120 --seconds 90 --interval 2]

A real exporter holds one run of 8 ranks driven by real clients (every standard field, tokens,
an evaluation, a checkpoint); one scrape of it gives the rank and run series of one node as
they are exposed. A local HTTP server then serves that node ``--large`` times over, each copy a
different run id and instance (what a fleet looks like to Prometheus after job turnover: the
same series shapes under new run ids), with values that change every scrape. Debian's
Prometheus scrapes ``--small`` copies for ``--seconds``, then ``--large`` copies for as long,
and reads its own ``prometheus_tsdb_head_series``, ``process_resident_memory_bytes`` and
``go_memstats_heap_inuse_bytes`` at the end of each phase. The figure is the growth between
the two phases divided by the head series added: bytes per head series, the process's fixed
cost left out. Samples of a series beyond its open head chunk are memory-mapped from disk
(Prometheus 2.19 and later), so a phase of a few dozen scrapes shows the steady state's cost
up to a partly filled chunk.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml
from _harness import start_prometheus

import trainmon_client
from trainmon_exporter.local import LocalExporter, free_port

RANKS = 8
RUN = "bench-node"


def node_template() -> str:
    """The rank and run series of one node of 8 ranks, as a real exporter exposes them, with
    the run id replaced by ``__RUN__`` (sample lines only)."""
    with LocalExporter() as ex:
        runs = [
            trainmon_client.init(
                run=RUN,
                rank=r,
                local_rank=r,
                world_size=RANKS,
                socket_path=ex.socket,
                flush_interval=0.0,
            )
            for r in range(RANKS)
        ]
        for step in range(30):
            for r in runs:
                r.log(
                    step,
                    loss=2.0 + 0.01 * step,
                    lr=3e-4,
                    grad_norm=0.8,
                    tokens=4096,
                    samples=8,
                    mem_allocated=2e9,
                )
            time.sleep(0.02)
        for r in runs:
            r.eval(30, val_loss=2.3)
            r.checkpoint(30, seconds=0.5)
        time.sleep(1.0)
        with urllib.request.urlopen(ex.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for r in runs:
            r.finish()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    ranked = [ln for ln in lines if f'run="{RUN}"' in ln]
    return "\n".join(ranked).replace(f'run="{RUN}"', 'run="__RUN__"') + "\n"


_VALUE = re.compile(r" ([0-9.eE+-]+)$", re.M)


def shifted(template: str) -> str:
    """The same series with every value changed, so that consecutive samples differ."""
    return _VALUE.sub(lambda m: f" {float(m[1]) + 1.5:g}", template)


class Server:
    """Serves ``/metrics?copy=I``: the node template under run id ``run-I``."""

    def __init__(self, template: str) -> None:
        variants = [template, shifted(template)]
        scrapes: dict[str, int] = {}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                copy = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["copy"][0]
                n = scrapes[copy] = scrapes.get(copy, 0) + 1
                body = variants[n % 2].replace("__RUN__", f"run-{copy}").encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.port = free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def own_metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    want = (
        "prometheus_tsdb_head_series",
        "process_resident_memory_bytes",
        "go_memstats_heap_inuse_bytes",
    )
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[name] = float(value)
    return out


def set_targets(path: Path, port: int, copies: int) -> None:
    groups = [
        {
            "targets": [f"127.0.0.1:{port}"],
            "labels": {"__param_copy": str(i), "instance": f"node{i:04d}:9478"},
        }
        for i in range(copies)
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups))
    tmp.replace(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", type=int, default=20, help="nodes in the first phase")
    ap.add_argument("--large", type=int, default=120, help="nodes in the second phase")
    ap.add_argument("--seconds", type=float, default=90.0, help="length of each phase")
    ap.add_argument("--interval", type=float, default=2.0, help="scrape interval, seconds")
    ap.add_argument(
        "--smoke", action="store_true", help="seconds: 1 and 3 nodes (figures not meaningful)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.small, args.large, args.seconds, args.interval = 1, 3, 4.0, 1.0
    if shutil.which("prometheus") is None:
        raise SystemExit("needs Debian's prometheus package")
    template = node_template()
    per_node = template.count("\n")
    server = Server(template)
    tmp = Path(tempfile.mkdtemp(prefix="tm-prom-mem-"))
    targets = tmp / "targets.json"
    set_targets(targets, server.port, args.small)
    interval = f"{int(args.interval * 1000)}ms"
    config = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval},
        "scrape_configs": [
            {
                "job_name": "trainmon",
                "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
            }
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc, log = start_prometheus(tmp, port)
    base = f"http://127.0.0.1:{port}"
    try:
        phases = []
        for copies in (args.small, args.large):
            set_targets(targets, server.port, copies)
            time.sleep(args.seconds)
            phases.append(own_metrics(base))
        version = subprocess.run(
            ["prometheus", "--version"], capture_output=True, text=True, check=False
        ).stdout.splitlines()[0]
        print(f"{version}; one node = {per_node} rank and run series ({RANKS} ranks)")
        print(f"scrape every {args.interval:g} s, {args.seconds:g} s per phase")
        print(f"{'nodes':>6}{'head series':>13}{'RSS MiB':>10}{'heap in use MiB':>17}")
        for copies, m in zip((args.small, args.large), phases, strict=True):
            print(
                f"{copies:>6}{m['prometheus_tsdb_head_series']:>13,.0f}"
                f"{m['process_resident_memory_bytes'] / 2**20:>10.0f}"
                f"{m['go_memstats_heap_inuse_bytes'] / 2**20:>17.0f}"
            )
        added = phases[1]["prometheus_tsdb_head_series"] - phases[0]["prometheus_tsdb_head_series"]
        if added > 0:
            for key, what in (
                ("process_resident_memory_bytes", "RSS"),
                ("go_memstats_heap_inuse_bytes", "Go heap in use"),
            ):
                grown = phases[1][key] - phases[0][key]
                print(f"{what} per added head series: {grown / added:,.0f} bytes")
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
