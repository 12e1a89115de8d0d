"""Run a throw-away exporter as a subprocess: for notebooks, demos, benchmarks and scripts.

Example:
    >>> from trainmon_exporter.local import LocalExporter
    >>> with LocalExporter() as ex:  # doctest: +SKIP
    ...     run = trainmon_client.init(run="nb", socket_path=ex.socket)
    ...     print(ex.url + "/metrics")
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any


def free_port(preferred: int = 0) -> int:
    """``preferred`` if it is free on 127.0.0.1, else any free port."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free TCP port on 127.0.0.1")


class LocalExporter:
    """``python -m trainmon_exporter`` on 127.0.0.1 with a socket in a fresh temporary directory.

    Args:
        *args: extra exporter flags (e.g. ``"--series-ttl-seconds", "60"``).
        port: preferred HTTP port (any free one if it is taken; 0: any).
        quiet: pass ``--log-level warning``.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        socket: the Unix socket path to give ``trainmon_client.init(socket_path=...)``.
    """

    def __init__(self, *args: str, port: int = 0, quiet: bool = True) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="trainmon-"))
        self.socket = str(self._dir / "trainmon.sock")
        self.port = free_port(port)
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "trainmon_exporter",
            "--socket",
            self.socket,
            "--listen",
            f"127.0.0.1:{self.port}",
            *args,
        ]
        if quiet:
            cmd += ["--log-level", "warning"]
        self._cmd = cmd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> LocalExporter:
        """Start the process and wait for ``/readyz``; a running one is kept (returns self).

        Raises:
            RuntimeError: it exited or was not ready within ``timeout`` seconds.
        """
        if self.proc is not None and self.proc.poll() is None:
            return self  # ``with LocalExporter().start() as ex`` must not start a second one
        self.proc = subprocess.Popen(self._cmd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exporter exited with code {self.proc.returncode}")
            try:
                if self.get_json("/readyz").get("status") == "ready":
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("exporter not ready in time")

    def get(self, path: str) -> bytes:
        """GET ``path`` from the exporter's HTTP server."""
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return bytes(r.read())

    def get_json(self, path: str) -> Any:
        """GET ``path`` and decode JSON."""
        return json.loads(self.get(path))

    def stop(self) -> None:
        """SIGTERM, wait, and remove the temporary directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> LocalExporter:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
