"""``trainmon-exporter`` / ``python -m trainmon_exporter``: parse settings, check, serve."""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn
from pydantic import ValidationError

from trainmon_exporter import __version__
from trainmon_exporter.settings import Settings

PROG = "trainmon-exporter"


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def load_settings(argv: Sequence[str]) -> Settings:
    """Settings from the environment (``TRAINMON_*``) overridden by CLI flags.

    Raises:
        pydantic.ValidationError: a value is invalid.
        SystemExit: ``--help`` was given, or argparse rejected a flag.
    """
    return Settings(_cli_parse_args=list(argv))  # type: ignore[call-arg]


def _bind_http(settings: Settings) -> socket.socket:
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    return socket.create_server((settings.host, settings.port), family=family, backlog=128)


def _check_socket_dir(path: Path) -> str | None:
    """Why the ingest socket cannot be created at ``path``, or None when it can."""
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return (
            f"cannot create the socket directory {parent} ({exc.strerror}); pass --socket PATH "
            "(or TRAINMON_SOCKET) in a writable directory, e.g. /tmp/trainmon/trainmon.sock"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        return (
            f"socket directory {parent} is not writable by this user; pass --socket PATH (or "
            "TRAINMON_SOCKET) in a writable directory, e.g. /tmp/trainmon/trainmon.sock"
        )
    if len(os.fsencode(path)) >= 108:
        return f"socket path {path} is longer than the 107 bytes Unix sockets allow"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the exporter until SIGINT/SIGTERM. Returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "status":  # trainmon-exporter status: the terminal view
        from trainmon_exporter.status import main as status_main

        return status_main(argv[1:])
    if "--version" in argv:
        print(f"{PROG} {__version__}")
        return 0
    try:
        settings = load_settings(argv)
    except ValidationError as exc:
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "settings"
            print(f"{PROG}: error: {where}: {err['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    problem = _check_socket_dir(settings.socket)
    if problem:
        return _fail(problem)
    from trainmon_exporter.ingest import IngestServer, SocketInUseError

    try:
        IngestServer(settings.socket, None, None)._remove_stale()  # type: ignore[arg-type]
    except SocketInUseError as exc:
        return _fail(f"{exc}; stop it or pass another --socket PATH")
    except OSError as exc:
        return _fail(f"cannot use {settings.socket}: {exc.strerror}")
    try:
        http_sock = _bind_http(settings)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return _fail(
                f"{settings.listen} is already in use (another exporter?); pick another with "
                "--listen HOST:PORT or TRAINMON_LISTEN"
            )
        return _fail(f"cannot listen on {settings.listen}: {exc.strerror}")
    if settings.require_gpus and (settings.collectors.gpu or settings.collectors.rank_gpu):
        from trainmon_exporter.nvml import GpuSampler, PynvmlBackend

        probe = GpuSampler(PynvmlBackend())
        if not probe.open():
            snap = probe.snapshot
            hint = f". HINT: {snap.hint}" if snap.hint else ""
            return _fail(f"require_gpus is set but NVML is unusable: {snap.error}{hint}")
        probe.stop()
    from trainmon_exporter.app import create_app

    app = create_app(settings)
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    host, port = http_sock.getsockname()[:2]
    print(
        f"{PROG} {__version__}: metrics on http://{host}:{port}/metrics, status page "
        f"http://{host}:{port}/, trainers connect to {settings.socket}",
        flush=True,
    )
    try:
        server.run(sockets=[http_sock])
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its clean shutdown
        return 130
    return 0 if server.started else 1
