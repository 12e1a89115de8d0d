"""Shared fixtures: real exporters (in-process and as subprocesses), raw sockets, waiting."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

import trainmon_client
from trainmon_exporter import Settings, create_app
from trainmon_exporter.local import LocalExporter
from trainmon_exporter.local import free_port as free_port  # the tests' free ports

ROOT = Path(__file__).resolve().parents[1]

# Off Kubernetes for every client of the suite and its subprocesses, also where the suite runs
# in a pod (a CI runner on Kubernetes): POD_NAMESPACE set empty reads no service-account file.
# The tests of attribution per team set their pod's variables themselves.
os.environ["POD_NAMESPACE"] = ""
os.environ.pop("POD_NAME", None)

# The suite never reaches a socket it did not make, whoever runs it and whatever the node has:
# an exporter of this user already running (on $XDG_RUNTIME_DIR/trainmon), a root one on
# /run/trainmon, a /run/trainmon this user may not use. Every client of the suite and of its
# subprocesses that is given no socket sends to TRAINMON_SOCKET, a path in a directory of the
# suite's own where nothing listens (its drops are counted, as with no exporter), and the
# runtime directory the socket rule falls back to is the suite's too. Tests of the rule itself
# pass their own environment and stand-in for /run/trainmon (tests/exporter/
# test_default_socket.py); tests that start the README's commands start their exporter first.
SUITE_DIR = Path(tempfile.mkdtemp(prefix="tm-suite-"))
_MADE_BY = os.getpid()
# Removed when the process that made it ends (a helper script importing this module too), never
# by a forked child that exits first.
atexit.register(lambda: os.getpid() == _MADE_BY and shutil.rmtree(SUITE_DIR, ignore_errors=True))
NOWHERE = str(SUITE_DIR / "nobody-listens.sock")
"""Where a client of the suite sends when a test gives it no socket: nothing listens there."""
os.environ["XDG_RUNTIME_DIR"] = str(SUITE_DIR)
os.environ["TRAINMON_SOCKET"] = NOWHERE


def pytest_configure(config: pytest.Config) -> None:
    """Let the suite's subprocesses be stopped with Ctrl-C even if the suite itself was not.

    A non-interactive shell starts a background command (``bash .ci/run &``, ``(make test &)``)
    with SIGINT and SIGQUIT ignored, and an ignored signal stays ignored across ``exec``:
    Python then installs no KeyboardInterrupt handler, and the example trainer the pipeline
    tests stop with SIGINT trains on forever. Seen as ``SigIgn: ...06`` in the hung trainer's
    ``/proc/PID/status``. Restoring Python's handler here gives children the default again.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def wait_for(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll ``cond`` until it returns something truthy; fail the test after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {cond}")
        time.sleep(interval)


def short_tmpdir() -> Path:
    """A short directory (Unix socket paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="tm-", dir="/tmp"))


def parse_metrics(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``{(sample name, labels): value}`` of a text exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(metrics: dict[Any, float], metric: str, /, **labels: str) -> float | None:
    return metrics.get((metric, frozenset(labels.items())))


class InProcessExporter:
    """The real app (lifespan, ingest socket, collectors) served by FastAPI's TestClient."""

    def __init__(self, settings: Settings, nvml: Any = None) -> None:
        self.settings = settings
        self.socket = str(settings.socket)
        self.app = create_app(settings, nvml)
        self.client = TestClient(self.app)

    def metrics_text(self) -> str:
        r = self.client.get("/metrics")
        assert r.status_code == 200
        return r.text

    def metrics(self) -> dict[Any, float]:
        return parse_metrics(self.metrics_text())

    def runs(self) -> dict[str, Any]:
        r = self.client.get("/api/v1/runs")
        assert r.status_code == 200
        return r.json()  # type: ignore[no-any-return]

    def rank(self, run: str, rank: int) -> dict[str, Any] | None:
        for r in self.runs()["runs"]:
            if r["run"] == run:
                for k in r["ranks"]:
                    if k["rank"] == rank:
                        return k  # type: ignore[no-any-return]
        return None


@pytest.fixture
def make_exporter() -> Iterator[Callable[..., InProcessExporter]]:
    """Factory for in-process exporters with settings overrides; all stopped at teardown."""
    made: list[tuple[InProcessExporter, Path]] = []

    def make(nvml: Any = None, **overrides: Any) -> InProcessExporter:
        """``nvml``: an NvmlBackend (e.g. tests/fakes/nvml_backend.py) instead of the real one."""
        d = short_tmpdir()
        settings = Settings(socket=d / "t.sock", **overrides)
        ex = InProcessExporter(settings, nvml)
        ex.client.__enter__()
        made.append((ex, d))
        return ex

    yield make
    for ex, d in made:
        ex.client.__exit__(None, None, None)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def exporter(make_exporter: Callable[..., InProcessExporter]) -> InProcessExporter:
    return make_exporter()


class ExporterProcess(LocalExporter):
    """``python -m trainmon_exporter`` as a real subprocess on ``socket_path`` and ``port``.

    A :class:`~trainmon_exporter.local.LocalExporter` at the default log level, its output
    collected: ``stop()`` returns it, and a process that exits early fails the test with it.
    """

    def __init__(
        self, socket_path: Path, port: int, *args: str, env: dict[str, str] | None = None
    ) -> None:
        super().__init__(
            *args, port=port, quiet=False, socket_path=socket_path, env=env, capture_output=True
        )

    def start(self, timeout: float = 20.0, *, wait: bool = True) -> ExporterProcess:
        super().start(timeout, wait=wait)
        return self

    def metrics(self) -> dict[Any, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=5).text)

    def runs(self) -> dict[str, Any]:
        return httpx.get(self.url + "/api/v1/runs", timeout=5).json()  # type: ignore[no-any-return]


@pytest.fixture
def exporter_process() -> Iterator[Callable[..., ExporterProcess]]:
    made: list[tuple[ExporterProcess, Path]] = []

    def make(
        *args: str,
        socket_dir: Path | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> ExporterProcess:
        d = socket_dir or short_tmpdir()
        ex = ExporterProcess(d / "t.sock", port or free_port(), *args, env=env)
        made.append((ex, d))
        return ex

    yield make
    for ex, d in made:
        if ex.proc is not None and ex.proc.poll() is None:
            ex.stop(signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


def connect(
    exporter: Any, run: str, rank: int = 0, world_size: int = 1, **kwargs: Any
) -> trainmon_client.Run:
    """A client of ``exporter`` (anything with ``.socket``) that sends every step at once.

    ``local_rank`` defaults to ``rank``; other keywords go to :func:`trainmon_client.init`.
    """
    kwargs.setdefault("local_rank", rank)
    kwargs.setdefault("flush_interval", 0.0)
    return trainmon_client.init(
        run=run, rank=rank, world_size=world_size, socket_path=exporter.socket, **kwargs
    )


def raw_connect(path: str) -> socket.socket:
    """A raw SOCK_SEQPACKET connection, for sending hand-made packets."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    return s


def child_env(**extra: str) -> dict[str, str]:
    """Environment for subprocesses: the current one without launcher variables (Slurm's too).

    ``TRAINMON_SOCKET`` is :data:`NOWHERE` unless ``extra`` names a socket: a child never
    reaches a socket the test did not make (the suite's runtime directory stays its own too).
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TRAINMON_RUN")
        and not k.startswith("SLURM_")  # a suite run inside a Slurm job
        and not k.startswith("TORCHELASTIC_")  # a suite run under torchrun
    }
    env["TRAINMON_SOCKET"] = NOWHERE
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_trainer(script: Path, source: str, sock: str) -> subprocess.CompletedProcess[str]:
    """``source`` written to ``script`` and run to its end (60 s at most) as a trainer of the
    exporter listening at ``sock``; its output captured, its exit status not checked."""
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script)],
        env=child_env(TRAINMON_SOCKET=sock),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def trainmon_status(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m trainmon_exporter status ARGS`` as a user would run it (not checked)."""
    return subprocess.run(
        [sys.executable, "-m", "trainmon_exporter", "status", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        check=False,
    )


def require_tool(name: str, package: str) -> str:
    """Path of a Debian-packaged tool (promtool, amtool).

    Skips the test where it is missing, except in CI (``CI_REQUIRE_TOOLS``, set by
    ``.ci/run``, which installs them), where it fails.
    """
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI_REQUIRE_TOOLS"):
            pytest.fail(f"{name} is required in CI (Debian package {package})")
        pytest.skip(f"{name} not installed")
    return path


def promtool_check_metrics(text: str) -> None:
    """Fail unless ``promtool check metrics`` accepts ``text`` without a word."""
    promtool = require_tool("promtool", "prometheus")
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "" and out.stderr.strip() == ""  # not even a lint warning


def tiny_model() -> tuple[Any, Any]:
    """A 3-layer MLP (layers named 0, 2, 4 by nn.Sequential) and an AdamW optimizer."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 1),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
