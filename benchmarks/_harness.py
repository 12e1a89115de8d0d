"""Shared pieces of the benchmarks: a real exporter subprocess with a chosen open-file limit, a
real Prometheus, a ``/healthz`` prober, raw trainer packets, and process measurements (psutil).
"""

from __future__ import annotations

import http.client
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import psutil

from trainmon_client import _protocol as P


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


ROOT = os.geteuid() == 0
"""Whether attacks can run clients as other uids (``Popen(user=...)`` needs root)."""
UID_A, UID_B = 61001, 61002
"""Unprivileged uids (no passwd entry needed) the multi-uid attacks run clients as."""


DROP = """
import os as _os
if _os.environ.get("TM_BENCH_UID"):
    _uid = int(_os.environ["TM_BENCH_UID"])
    _os.setgroups([])
    _os.setgid(_uid)
    _os.setuid(_uid)
"""
"""Code a child script runs after its imports: become ``TM_BENCH_UID`` if set (the
interpreter may live where other uids cannot read, so children start as root and drop)."""


FD_SPARE = 128
"""Descriptors kept free beyond a benchmark's own connections (the prober's connection, the
exporter's pipes, Python's own files)."""


def fd_budget(need: int, what: str) -> int:
    """How many of ``need`` connections this process can hold open, raising its soft limit.

    The soft ``RLIMIT_NOFILE`` is raised toward ``need + FD_SPARE`` (up to the hard limit,
    which an unprivileged user cannot raise: ``ulimit -n 1024`` sets both); when that is not
    enough the benchmark scales down to what fits and prints a line saying so. Children
    started afterwards inherit the raised limit.
    """
    want = need + FD_SPARE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            print(f"[{what}] raised the open-file soft limit from {soft} to {target}")
            soft = target
    if soft == resource.RLIM_INFINITY or soft >= want:
        return need
    fit = max(1, soft - FD_SPARE)
    print(
        f"[{what}] scaled down to {fit} of {need} connections: the open-file limit is {soft} "
        f"(hard {hard}); raise it (ulimit -n {want}) for the full attack"
    )
    return fit


def start_prometheus(tmp: Path, port: int) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """A real ``prometheus`` reading ``tmp/prometheus.yml``, its TSDB in ``tmp/tsdb``, serving
    on 127.0.0.1:``port``, its output in ``tmp/prom.log``.

    Returns the process and the open log; the caller terminates the one and closes the other.
    """
    log = (tmp / "prom.log").open("wb")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return proc, log


def as_uid(uid: int | None) -> dict[str, Any]:
    """``subprocess.Popen`` keyword arguments that make a child running :data:`DROP` become
    ``uid`` (group ``uid``, no supplementary groups); ``{}`` for None (this process's uid)."""
    if uid is None:
        return {}
    return {"env": {**os.environ, "TM_BENCH_UID": str(uid)}}


class Exporter:
    """``python -m trainmon_exporter`` with an optional RLIMIT_NOFILE (soft = hard).

    ``shared``: the socket is reachable by every uid (directory 0755, socket mode 0666), as on
    a node shared by several users' trainers.
    """

    def __init__(self, *args: str, nofile: int | None = None, shared: bool = False) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tm-b-", dir="/tmp"))
        self.socket = str(self.dir / "t.sock")
        if shared:
            self.dir.chmod(0o755)
            args = ("--socket-mode", "0666", *args)
        self.port = free_port()
        self.log_bytes = 0
        self.log_lines = 0
        cmd = [sys.executable, "-m", "trainmon_exporter", "--socket", self.socket]
        cmd += ["--listen", f"127.0.0.1:{self.port}", "--log-level", "warning", *args]

        if nofile is not None:  # never above the hard limit, which only root may raise
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            if hard != resource.RLIM_INFINITY:
                nofile = min(nofile, hard)
        self.nofile = nofile

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=limit
        )
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 30
        while True:
            try:
                if get(self.port, "/readyz", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("exporter did not start")
            time.sleep(0.1)

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log_bytes += len(line)
            self.log_lines += 1

    def cpu_seconds(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def rss_mib(self) -> float:
        return float(self.ps.memory_info().rss) / 2**20

    def metric(self, prefix: str, timeout: float = 30) -> float | None:
        """Sum of the samples whose line starts with ``prefix`` (None: scrape failed)."""
        try:
            status, body = get(self.port, "/metrics", timeout=timeout)
        except OSError:
            return None
        if status != 200:
            return None
        total = None
        for line in body.decode().splitlines():
            if line.startswith(prefix):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """One GET on a fresh connection: ``(status, body)``; raises OSError on failure."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


class Prober(threading.Thread):
    """GET ``path`` every ``interval`` s on a fresh connection; records latency and failures."""

    def __init__(self, port: int, path: str = "/healthz", interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.port, self.path, self.interval = port, path, interval
        self.latencies: list[float] = []
        self.failures = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            t0 = time.perf_counter()
            try:
                status, _ = get(self.port, self.path, timeout=5)
                ok = status == 200
            except OSError:
                ok = False
            dt = time.perf_counter() - t0
            if ok:
                self.latencies.append(dt)
            else:
                self.failures += 1
            self._halt.wait(max(0.0, self.interval - dt))

    def stop(self) -> Prober:
        self._halt.set()
        self.join(10)
        return self

    def summary(self) -> str:
        return latency_summary(self.latencies, self.failures)

    def p50_ms(self) -> float:
        """Median latency (ms); infinite when no probe was answered."""
        return statistics.median(self.latencies) * 1e3 if self.latencies else float("inf")


def latency_summary(lat: list[float], failures: int = 0) -> str:
    if not lat:
        return f"no answer ({failures} failed)"
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else [lat[0]] * 99
    return (
        f"p50 {statistics.median(lat) * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms, "
        f"max {max(lat) * 1e3:.1f} ms ({len(lat)} ok, {failures} failed/timed out)"
    )


def hello(run: str, rank: int = 0, world_size: int = 1) -> bytes:
    fields: dict[str, Any] = {k: None for k in P.HELLO_FIELDS} | {
        "run": run,
        "rank": rank,
        "local_rank": rank,
        "world_size": world_size,
        "hostname": "bench",
        "pid": os.getpid(),
        "client_version": "bench",
        "started_at": time.time(),
        "dtype": "bf16",
    }
    return P.encode_hello(fields)


def step_records(first: int, n: int, n_custom: int = 0) -> bytes:
    """``n`` STEP records from step ``first`` with loss/lr and ``n_custom`` custom ids 64..."""
    nf = 2 + n_custom
    s = P.step_struct(nf)
    ids = (1, 2, *range(P.FIRST_CUSTOM_ID, P.FIRST_CUSTOM_ID + n_custom))
    vals = (1.0, 1e-3, *([0.5] * n_custom))
    now = time.time()
    out = []
    for i in range(first, first + n):
        out.append(
            s.pack(
                P.STEP,
                P.step_payload_length(nf),
                i,
                i + 1,
                now,
                0.1,
                float(i),
                float(i),
                0.0,
                0,
                0,
                0,
                *ids,
                *vals,
            )
        )
    return b"".join(out)


def raw_connect(path: str, timeout: float | None = 5.0) -> socket.socket:
    """A SOCK_SEQPACKET connection; a full listen queue (EAGAIN) is retried until ``timeout``."""
    deadline = time.monotonic() + (timeout or 0.0)
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(timeout)
        try:
            s.connect(path)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)
        except OSError:
            s.close()
            raise


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    sxx = sum((t - mx) ** 2 for t, _ in points)
    if sxx == 0:
        return 0.0
    return 60.0 * sum((t - mx) * (v - my) for t, v in points) / sxx
