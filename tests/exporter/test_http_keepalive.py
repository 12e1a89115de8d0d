"""An idle HTTP keep-alive connection is closed after ``http_timeout_keep_alive_seconds``."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

from ..conftest import ExporterProcess

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def read_response(s: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += s.recv(4096)
    return head


@pytest.mark.slow
def test_idle_keep_alive_connections_are_closed_and_busy_ones_kept(
    exporter_process: Callable[..., ExporterProcess],
) -> None:
    ex = exporter_process("--http-timeout-keep-alive-seconds", "1").start()
    with socket.create_connection(("127.0.0.1", ex.port)) as s:
        s.settimeout(10)
        for _ in range(3):  # requests within the timeout reuse the connection
            s.sendall(REQUEST)
            assert read_response(s).startswith(b"HTTP/1.1 200")
            time.sleep(0.3)
        t0 = time.monotonic()
        assert s.recv(100) == b""  # then, idle, the server closes it
        waited = time.monotonic() - t0
    assert 0.4 < waited < 4, waited
