"""A private Docker engine and stand-in images for running docker-compose.yml for real.

Debian's ``dockerd`` runs as a plain process (vfs storage, no iptables, no default bridge) on
its own socket; nothing is pulled. The images the compose file names are built locally:

- a base image from ``debootstrap --variant=minbase bookworm``, imported with ``docker import``;
- ``python:3.11-slim``: Debian's python3 (3.11) and pip, the host's CA bundle (pip inside a
  build reaches the package index as pip on the host does) and the host's local wheels
  (``/opt/wheels``: the CPU torch wheel the demo installs, whose own index is unreachable
  here; PyPI stays an extra index for its dependencies);
- ``prom/prometheus`` and ``prom/alertmanager``: Debian's ``prometheus`` and
  ``prometheus-alertmanager``, the binary as entrypoint, user ``nobody`` (65534:65534), as the
  upstream images.

The engine's data root lives in a cache directory (``TRAINMON_DOCKER_CACHE``, default
``$XDG_CACHE_HOME/trainmon/docker``) and every stand-in is tagged with a hash of its inputs,
so a second run reuses the images and Docker's layer cache for the repository's own images.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import pytest

from .stack import require_binaries

BOOKWORM_MIRROR = "http://deb.debian.org/debian"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_WHEELS = Path("/opt/wheels")

PYTHON_DOCKERFILE = """\
FROM {base}
RUN apt-get update -qq \\
 && apt-get install -y -qq --no-install-recommends python3 python3-pip python-is-python3 \\
      ca-certificates >/dev/null \\
 && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/EXTERNALLY-MANAGED
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY wheels /wheels
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_FIND_LINKS=/wheels PIP_RETRIES=0 \\
    PIP_EXTRA_INDEX_URL=https://pypi.org/simple \\
    PIP_DEFAULT_TIMEOUT=20 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
CMD ["python3"]
"""

PROM_BASE_DOCKERFILE = """\
FROM {base}
RUN apt-get update -qq \\
 && apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager \\
      >/dev/null \\
 && rm -rf /var/lib/apt/lists/*
"""

PROMETHEUS_DOCKERFILE = """\
FROM {prom_base}
RUN mkdir -p /prometheus && chown 65534:65534 /prometheus
USER 65534:65534
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
"""

ALERTMANAGER_DOCKERFILE = """\
FROM {prom_base}
RUN mkdir -p /alertmanager && chown 65534:65534 /alertmanager
USER 65534:65534
WORKDIR /alertmanager
ENTRYPOINT ["/usr/bin/prometheus-alertmanager"]
CMD ["--config.file=/etc/alertmanager/alertmanager.yml", "--storage.path=/alertmanager"]
"""


def require_engine() -> None:
    """Skip unless a private Docker engine can be started here: dockerd and docker
    (``docker.io``), debootstrap for the stand-in base images, and root."""
    require_binaries("dockerd", "docker", package="docker.io")
    require_binaries("debootstrap", package="debootstrap")
    if os.geteuid() != 0:
        pytest.skip("dockerd needs root")


def cache_dir() -> Path:
    env = os.environ.get("TRAINMON_DOCKER_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "trainmon" / "docker"


def _digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


class EngineUnavailable(Exception):
    """dockerd could not start here (no privileges, no cgroups, ...): the reason."""


class Engine:
    """One dockerd on a private socket, its data root in the cache directory."""

    def __init__(self, run_dir: Path, log: IO[bytes]) -> None:
        self.cache = cache_dir()
        self.cache.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.sock = run_dir / "docker.sock"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.sock}"}
        self.env.pop("DOCKER_CONTEXT", None)
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = (self.cache / "lock").open("w")

    def start(self, timeout: float = 60) -> None:
        """Start dockerd on the shared cache; on any failure nothing is left held or open."""
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            self._lock.close()
            raise EngineUnavailable(f"another test run holds {self.cache}") from e
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        self.proc = subprocess.Popen(
            [
                "dockerd",
                f"--data-root={self.cache / 'data'}",
                f"--exec-root={self.run_dir / 'exec'}",
                f"--pidfile={self.run_dir / 'docker.pid'}",
                f"-H=unix://{self.sock}",
                "--storage-driver=vfs",
                "--iptables=false",
                "--ip6tables=false",
                "--bridge=none",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineUnavailable(f"dockerd exited with status {self.proc.returncode}")
            if self.docker("info", check=False, capture=True).returncode == 0:
                return
            time.sleep(0.5)
        raise EngineUnavailable(f"dockerd did not answer on {self.sock} within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._lock.closed:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()

    def docker(
        self, *args: str, check: bool = True, capture: bool = False, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            ["docker", *args],
            env=self.env,
            text=True,
            capture_output=capture,
            stdout=None if capture else self.log,
            stderr=None if capture else subprocess.STDOUT,
            check=False,
            **kw,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)} failed ({out.returncode})")
        return out

    def has_image(self, tag: str) -> bool:
        return self.docker("image", "inspect", tag, check=False, capture=True).returncode == 0

    def build(self, tag: str, dockerfile: str, context: Path, *aliases: str) -> None:
        (context / "Dockerfile").write_text(dockerfile)
        self.docker("build", "--network=host", "-q", "-t", tag, str(context))
        for alias in aliases:
            self.docker("tag", tag, alias)


def build_standins(engine: Engine, timings: dict[str, float]) -> None:
    """Build (or find in the cache) the stand-ins for every image docker-compose.yml pulls,
    tagged with the compose file's names; ``timings`` gets the seconds each step took."""
    t0 = time.monotonic()
    base = f"trainmon-standin/base:{_digest('bookworm', 'minbase', BOOKWORM_MIRROR)}"
    if not engine.has_image(base):
        with tempfile.TemporaryDirectory(dir=engine.cache) as tmp:
            root = Path(tmp) / "rootfs"
            subprocess.run(
                ["debootstrap", "--variant=minbase", "bookworm", str(root), BOOKWORM_MIRROR],
                stdout=engine.log,
                stderr=subprocess.STDOUT,
                check=True,
            )
            with subprocess.Popen(
                ["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE
            ) as tar:
                engine.docker("import", "-", base, stdin=tar.stdout)
            assert tar.returncode == 0
        timings["base (debootstrap + import)"] = time.monotonic() - t0

    ca = CA_BUNDLE.read_bytes()
    wheels = sorted(HOST_WHEELS.glob("*.whl")) if HOST_WHEELS.is_dir() else []
    py_file = PYTHON_DOCKERFILE.format(base=base)
    python = f"trainmon-standin/python:{_digest(py_file, ca, *[w.name for w in wheels])}"
    t1 = time.monotonic()
    if not engine.has_image(python):
        with tempfile.TemporaryDirectory(dir=engine.cache) as tmp:
            ctx = Path(tmp)
            (ctx / "ca-certificates.crt").write_bytes(ca)
            (ctx / "wheels").mkdir()
            for w in wheels:
                shutil.copy(w, ctx / "wheels")
            engine.build(python, py_file, ctx)
        timings["python stand-in"] = time.monotonic() - t1
    engine.docker("tag", python, "python:3.11-slim")

    prom_file = PROM_BASE_DOCKERFILE.format(base=base)
    prom_base = f"trainmon-standin/prom:{_digest(prom_file)}"
    t2 = time.monotonic()
    for tag, text, name in (
        (prom_base, prom_file, None),
        (
            f"trainmon-standin/prometheus:{_digest(prom_base, PROMETHEUS_DOCKERFILE)}",
            PROMETHEUS_DOCKERFILE.format(prom_base=prom_base),
            "prometheus",
        ),
        (
            f"trainmon-standin/alertmanager:{_digest(prom_base, ALERTMANAGER_DOCKERFILE)}",
            ALERTMANAGER_DOCKERFILE.format(prom_base=prom_base),
            "alertmanager",
        ),
    ):
        if not engine.has_image(tag):
            with tempfile.TemporaryDirectory(dir=engine.cache) as tmp:
                engine.build(tag, text, Path(tmp))
        if name is not None:
            engine.docker("tag", tag, compose_image(name))
    if time.monotonic() - t2 > 5:
        timings["prometheus and alertmanager stand-ins"] = time.monotonic() - t2


def compose_image(service: str) -> str:
    """The image docker-compose.yml names for ``service``."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    services = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]
    return str(services[service]["image"])
