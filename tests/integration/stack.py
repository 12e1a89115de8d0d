"""The real monitoring stack for integration tests: Alertmanager with the shipped routes and
templates, Prometheus (server, agent or remote-write receiver), VictoriaMetrics and vmalert as
plain processes on loopback, and an HTTP receiver that records what Alertmanager delivers.

Only timing (1 s intervals, short group waits), addresses and file locations are changed from
the shipped configuration.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..conftest import ROOT, free_port

PROM_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = [
    PROM_DIR / "trainmon.rules.yml",
    PROM_DIR / "trainmon.alerts.yml",
    PROM_DIR / "trainmon.watchdog.alerts.yml",
]


def require_binaries(*names: str, package: str) -> None:
    """Skip the test where a Debian-packaged binary is missing; fail instead in CI.

    CI (``.ci/run``, which sets ``CI_REQUIRE_TOOLS``) installs them, so a missing one
    there is a broken setup, not a reason to skip.
    """
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        if os.environ.get("CI_REQUIRE_TOOLS"):
            pytest.fail(f"{', '.join(missing)} required in CI (Debian package {package})")
        pytest.skip(f"{', '.join(missing)} not installed (Debian package {package})")


class Receiver:
    """Records every POST: (path, JSON body, arrival time)."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, Any, float]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.posts.append((self.path, json.loads(body or b"null"), time.time()))
                self.send_response(200 if self.path != "/pagerduty" else 202)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def find(self, path: str, *texts: str) -> list[tuple[Any, float]]:
        """(body, arrival time) of the POSTs to ``path`` whose JSON contains every text."""
        return [
            (b, t)
            for p, b, t in self.posts
            if p == path and all(text in json.dumps(b) for text in texts)
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Processes:
    """Long-running processes of one test module, each logging to its own file."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []

    def start(self, cmd: list[str], log: str, **kwargs: Any) -> subprocess.Popen[bytes]:
        out = (self.tmp / log).open("wb")
        self.logs.append(out)
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kwargs)
        self.procs.append(p)
        return p

    def log(self, name: str) -> str:
        """A process's output so far ("" before it started)."""
        f = self.tmp / name
        return f.read_text(errors="replace") if f.exists() else ""

    def dump(self, chars: int = 3000) -> None:
        """Print the end of every process's output (for a failed test)."""
        for f in sorted(self.tmp.glob("*.log")):
            print(f"--- {f.name}\n{f.read_text(errors='replace')[-chars:]}")

    def stop(self) -> None:
        """Stop in reverse order of start: writers before the stores they write to."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for out in self.logs:
            out.close()

    def alertmanager(self, receiver: Receiver) -> str:
        """Start Alertmanager with the shipped config, delivering to ``receiver``; its URL."""
        port = free_port()
        secrets = self.tmp / "secrets"
        secrets.mkdir(exist_ok=True)
        (secrets / "pagerduty_routing_key").write_text("test-routing-key-0123456789abcdef")
        (secrets / "slack_webhook_url").write_text(f"http://127.0.0.1:{receiver.port}/slack")
        am = yaml.safe_load((ROOT / "alertmanager" / "alertmanager.yml").read_text())
        am["templates"] = [str(ROOT / "alertmanager" / "templates" / "*.tmpl")]
        am["route"].update(group_wait="1s", group_interval="1s")
        for r in am["route"]["routes"]:
            r.update(group_wait="1s", group_interval="1s")
        for rec in am["receivers"]:
            for pd in rec.get("pagerduty_configs", []):
                pd["routing_key_file"] = str(secrets / "pagerduty_routing_key")
                pd["url"] = f"http://127.0.0.1:{receiver.port}/pagerduty"
            for sl in rec.get("slack_configs", []):
                sl["api_url_file"] = str(secrets / "slack_webhook_url")
        (self.tmp / "alertmanager.yml").write_text(yaml.safe_dump(am))
        self.start(
            [
                "prometheus-alertmanager",
                f"--config.file={self.tmp / 'alertmanager.yml'}",
                f"--storage.path={self.tmp / 'am'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
            ],
            "am.log",
        )
        return f"http://127.0.0.1:{port}"

    def prometheus(self, config: dict[str, Any], name: str, *flags: str) -> str:
        """Start Prometheus with ``config`` (written as ``<name>.yml``); its URL."""
        port = free_port()
        (self.tmp / f"{name}.yml").write_text(yaml.safe_dump(config))
        data = (
            "--storage.agent.path" if "--enable-feature=agent" in flags else "--storage.tsdb.path"
        )
        self.start(
            [
                "prometheus",
                f"--config.file={self.tmp / f'{name}.yml'}",
                f"{data}={self.tmp / f'{name}-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                *flags,
            ],
            f"{name}.log",
        )
        return f"http://127.0.0.1:{port}"


def shipped(name: str) -> dict[str, Any]:
    """A shipped Prometheus config from deploy/prometheus/, as a dict to adapt."""
    return yaml.safe_load((PROM_DIR / name).read_text())  # type: ignore[no-any-return]


def fast_timing(cfg: dict[str, Any]) -> None:
    """1 s scrape and evaluation intervals, other global settings kept."""
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")


def query(url: str, expr: str) -> list[dict[str, Any]]:
    """Instant query against a Prometheus-compatible API; [] when it cannot answer yet."""
    q = urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=5) as r:
            return json.loads(r.read())["data"]["result"]  # type: ignore[no-any-return]
    except OSError:
        return []


def am_alerts(am_url: str, *matchers: str) -> list[dict[str, Any]]:
    """Alerts Alertmanager holds (``/api/v2/alerts``, muted ones included) for the matchers."""
    q = urllib.parse.urlencode([("filter", m) for m in matchers])
    with urllib.request.urlopen(f"{am_url}/api/v2/alerts?{q}", timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]
