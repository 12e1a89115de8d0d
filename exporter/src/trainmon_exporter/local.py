"""Run a throw-away exporter as a subprocess: for notebooks, demos, benchmarks and scripts.

The test suite starts its exporter processes with it too (``tests/conftest.py``).

Example:
    >>> from trainmon_exporter.local import LocalExporter
    >>> with LocalExporter() as ex:  # doctest: +SKIP
    ...     run = trainmon_client.init(run="nb", socket_path=ex.socket)
    ...     print(ex.url + "/metrics")
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
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
        socket_path: the ingest socket to use instead, in a directory the caller owns (it is
            not removed by :meth:`stop`).
        env: the process's environment (default: this one's).
        capture_output: collect the process's stdout and stderr; :meth:`stop` returns them.
        ssl_context: for an exporter serving TLS (``--web.config.file``): the client context
            that trusts its certificate; :attr:`url` is then ``https://``.
        auth: ``(user, password)`` sent as basic auth with every request of :meth:`get`.
        launcher: words put before the command, which must end by running it (``exec "$@"``
            for a shell): ``taskset``, ``unshare``, a wrapper that places the process first.

    Attributes:
        url: ``http://127.0.0.1:PORT`` (``https://`` with ``ssl_context``).
        socket: the Unix socket path to give ``trainmon_client.init(socket_path=...)``.
        proc: the process, once started.
    """

    def __init__(
        self,
        *args: str,
        port: int = 0,
        quiet: bool = True,
        socket_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        capture_output: bool = False,
        ssl_context: ssl.SSLContext | None = None,
        auth: tuple[str, str] | None = None,
        launcher: Sequence[str] = (),
    ) -> None:
        if socket_path is None:
            self._dir: Path | None = Path(tempfile.mkdtemp(prefix="trainmon-"))
            self.socket = str(self._dir / "trainmon.sock")
        else:
            self._dir = None
            self.socket = os.fspath(socket_path)
        self.port = free_port(port)
        self.url = f"{'http' if ssl_context is None else 'https'}://127.0.0.1:{self.port}"
        self.ssl_context = ssl_context
        self._headers = {}
        if auth is not None:
            token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
            self._headers["Authorization"] = f"Basic {token}"
        cmd = [
            *launcher,
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
        self._env = None if env is None else dict(env)
        self._capture = capture_output
        self._output = ""
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 30.0, *, wait: bool = True) -> LocalExporter:
        """Start the process and wait for ``/readyz``; a running one is kept (returns self).

        ``wait=False`` returns as soon as the process is started (poll :meth:`ready`).

        Raises:
            RuntimeError: it exited or was not ready within ``timeout`` seconds.
        """
        if self.proc is not None and self.proc.poll() is None:
            return self  # ``with LocalExporter().start() as ex`` must not start a second one
        self.proc = subprocess.Popen(
            self._cmd,
            stdout=subprocess.PIPE if self._capture else None,
            stderr=subprocess.STDOUT if self._capture else None,
            text=True,
            env=self._env,
        )
        if not wait:
            return self
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError("exporter not ready in time")

    def ready(self) -> bool:
        """Whether ``/readyz`` says ready.

        Raises:
            RuntimeError: the process has exited (with its output, when collected).
        """
        assert self.proc is not None, "not started"
        if self.proc.poll() is not None:
            out = self._wait(None).rstrip()
            detail = f":\n{out}" if out else ""
            raise RuntimeError(f"exporter exited with code {self.proc.returncode}{detail}")
        try:
            return bool(self.get_json("/readyz", timeout=1).get("status") == "ready")
        except (OSError, http.client.HTTPException, ValueError):
            return False  # not listening yet, 503, or cut off mid-answer

    def get(self, path: str, timeout: float = 10.0) -> bytes:
        """GET ``path`` from the exporter's HTTP server (with ``auth`` and ``ssl_context``)."""
        request = urllib.request.Request(self.url + path, headers=self._headers)
        with urllib.request.urlopen(request, timeout=timeout, context=self.ssl_context) as r:
            return bytes(r.read())

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        """GET ``path`` and decode JSON."""
        return json.loads(self.get(path, timeout))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> str:
        """Send ``sig``, wait (SIGKILL after ``timeout`` s) and remove the temporary directory.

        Returns the process's output when it is collected (``capture_output``), else ``""``.
        """
        out = ""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
            try:
                out = self._wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out = self._wait(None)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        return out

    def _wait(self, timeout: float | None) -> str:
        """Wait for the process to end; all it wrote, when collected (read once, then kept)."""
        assert self.proc is not None
        if self.proc.stdout is None or self.proc.stdout.closed:
            self.proc.wait(timeout)
        else:
            out, _ = self.proc.communicate(timeout=timeout)
            self._output += out or ""
        return self._output

    def __enter__(self) -> LocalExporter:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
