"""``trainmon-exporter`` / ``python -m trainmon_exporter``: parse settings, check, serve."""

from __future__ import annotations

import asyncio.constants
import errno
import logging
import os
import socket
import sys
from collections.abc import Sequence

import uvicorn
from pydantic import ValidationError
from pydantic_settings import SettingsError

from trainmon_exporter import __version__, logsetup
from trainmon_exporter.settings import Settings, unknown_environment
from trainmon_exporter.sockfile import IngestSocket, SocketSetupError

PROG = "trainmon-exporter"
GIL_SWITCH_INTERVAL_S = 0.001
"""sys.setswitchinterval for the exporter process (CPython default 0.005 s): see main()."""


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


def create_ingest_socket(settings: Settings) -> IngestSocket:
    """The ingest socket of ``settings``, created safely (see :mod:`trainmon_exporter.sockfile`).

    Raises:
        SocketSetupError: with a one-line reason: another exporter listens there or holds its
            lock, the directory is unsafe or cannot be created, the disk is full...
    """
    return IngestSocket.create(settings.socket, settings.socket_permissions, settings.socket_gid)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the exporter until SIGINT/SIGTERM. Returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "status":  # trainmon-exporter status: the terminal view
        from trainmon_exporter.views.terminal import main as status_main

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
    except SettingsError as exc:  # e.g. a list-valued variable that is not JSON
        cause = f" ({exc.__cause__})" if exc.__cause__ else ""
        return _fail(f"{exc}{cause}")
    for line in unknown_environment(os.environ):
        print(f"{PROG}: warning: {line}", file=sys.stderr)
    logsetup.setup(
        settings.log_level, settings.log_max_repeats, settings.log_repeat_interval_seconds
    )
    # Everything that can fail for a reason outside the program fails here, before uvicorn
    # starts, as one line and exit code 2 (never a traceback from the lifespan).
    try:
        listener = create_ingest_socket(settings)
    except SocketSetupError as exc:
        return _fail(str(exc))
    try:
        return _serve(settings, listener)
    finally:
        listener.close()  # removes the socket file only if the path still is ours


def _serve(settings: Settings, listener: IngestSocket) -> int:
    """Bind HTTP, check GPUs if required, and serve until stopped."""
    if settings.socket_permissions & 0o002:
        logging.getLogger("trainmon_exporter").warning(
            "socket %s is writable by every local user (socket_mode %s): any of them can "
            "claim a run id before its trainer does",
            settings.socket,
            settings.socket_mode,
        )
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
        from trainmon_exporter.nvml import PynvmlBackend
        from trainmon_exporter.sampler import GpuSampler

        probe = GpuSampler(PynvmlBackend())
        if not probe.open():
            snap = probe.snapshot
            hint = f". HINT: {snap.hint}" if snap.hint else ""
            return _fail(f"require_gpus is set but NVML is unusable: {snap.error}{hint}")
        probe.stop()
    from trainmon_exporter.app import create_app
    from trainmon_exporter.httplimits import HttpStats, protocol_class
    from trainmon_exporter.webconfig import WebConfigError, load_web_config

    try:  # TLS and basic auth (--web.config.file): a bad file or certificate stops here
        web = load_web_config(settings.web_config_file) if settings.web_config_file else None
        tls = web.ssl_context() if web is not None else None
    except WebConfigError as exc:
        return _fail(str(exc))
    if tls is not None:
        # asyncio gives a TLS handshake 60 s, during which the connection is not yet uvicorn's
        # (no limit_concurrency, no eviction): the header timeout bounds the handshake too.
        # uvicorn has no setting for it; asyncio reads this constant at each connection.
        asyncio.constants.SSL_HANDSHAKE_TIMEOUT = settings.http_header_timeout_seconds
    app = create_app(settings, listener=listener, web=web)
    stats = app.state.exporter.http_stats
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's loggers propagate to the rate-limited root handler
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=5,
        # uvicorn's h11 protocol plus a header timeout, eviction and a write timeout
        http=protocol_class(
            settings.http_header_timeout_seconds,
            settings.http_write_timeout_seconds,
            stats if stats is not None else HttpStats(),
        ),
        limit_concurrency=settings.http_limit_concurrency,
        timeout_keep_alive=settings.http_timeout_keep_alive_seconds,
        ssl_context_factory=None if tls is None else (lambda _config, _default: tls),
    )
    # A scrape renders in a worker thread that holds the GIL while the event loop waits for
    # it at every wake-up (a new connection, a readable socket). With CPython's default 5 ms
    # switch interval /healthz took 65 ms median under four concurrent scrapes of 64 ranks
    # x 250 custom metrics; with 1 ms, 17 ms (median of five runs each, test_limits.py's
    # concurrent-scrape test). Ingest alone runs on one thread and is not affected.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    server = uvicorn.Server(config)
    host, port = http_sock.getsockname()[:2]
    scheme = "http" if tls is None else "https"
    print(
        f"{PROG} {__version__}: metrics on {scheme}://{host}:{port}/metrics, status page "
        f"{scheme}://{host}:{port}/, trainers connect to {settings.socket}",
        flush=True,
    )
    try:
        server.run(sockets=[http_sock])
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its clean shutdown
        return 130
    return 0 if server.started else 1
