"""``trainmon-exporter`` / ``python -m trainmon_exporter``: parse settings, check, serve.

Why this module is one module of about 500 lines: it is everything a person sees before the
exporter serves (the flags and their one-line errors, the grouped help, each start-up check and
its exit code), and those parts share one parser and one way to fail; the settings themselves
are in :mod:`trainmon_exporter.settings`, the socket file in :mod:`trainmon_exporter.sockfile`.
"""

from __future__ import annotations

import argparse
import asyncio.constants
import difflib
import errno
import inspect
import ipaddress
import logging
import os
import re
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any, NoReturn

import uvicorn
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import CliSettingsSource, SettingsError

from trainmon_exporter import __version__, logsetup
from trainmon_exporter._defaults import socket_notes
from trainmon_exporter.settings import Settings, unknown_environment
from trainmon_exporter.sockfile import IngestSocket, SocketSetupError

PROG = "trainmon-exporter"
GIL_SWITCH_INTERVAL_S = 0.001
"""sys.setswitchinterval for the exporter process (CPython default 0.005 s): see main()."""


class OutputError(Exception):
    """Standard output cannot be written (a full disk, a closed pipe): reported as one line."""


def _silence(fd: int) -> None:
    """Point ``fd`` at /dev/null, so that Python's flush of it at exit cannot fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _fail(message: str) -> int:
    """Print ``trainmon-exporter: error: message`` on stderr; return exit code 2.

    If stderr cannot be written either (a full disk), the line is lost and the exit code
    still says it: never a traceback.
    """
    try:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    except OSError:
        _silence(2)
    return 2


def _say(text: str) -> None:
    """Print ``text`` on stdout and flush it.

    Raises:
        OutputError: stdout cannot be written; it is then pointed at /dev/null.
    """
    try:
        print(text, flush=True)
    except OSError as exc:
        _silence(1)
        raise OutputError(_output_error(exc)) from None


def _output_error(exc: OSError) -> str:
    """The one line for an unwritable stdout; empty for a reader that went away (``| head``)."""
    if exc.errno == errno.EPIPE:
        return ""
    return f"cannot write to standard output: {exc.strerror or exc}"


COMMON_FLAGS = (
    "listen",
    "socket",
    "socket_mode",
    "socket_group",
    "allowed_uids",
    "allowed_gids",
    "require_gpus",
    "peak_flops",
    "layer_ranks",
    "log_level",
)
"""Settings shown first in ``--help`` (the ones a deployment usually sets)."""
USAGE = (
    "%(prog)s [--listen HOST:PORT] [--socket PATH] [OPTION ...]\n"
    "       %(prog)s status [--url HOST:PORT]"
)


METAVARS = {
    "listen": "HOST:PORT",
    "socket": "PATH",
    "socket_mode": "MODE",
    "socket_group": "GROUP",
    "allowed_uids": "USER,...",
    "allowed_gids": "GROUP,...",
    "layer_ranks": "RANKS",
    "log_level": "LEVEL",
    "step_duration_buckets": "[SECONDS,...]",
    "collectors": "JSON",
    "analytics": "JSON",
    "analytics.spike_z": "JSON",
}


def metavar(dest: str, typename: str) -> str:
    """What ``--help`` shows after a flag: its unit or form, not pydantic's type name."""
    if dest in METAVARS:
        return METAVARS[dest]
    if dest.endswith("_seconds"):
        return "SECONDS"
    if typename.startswith("int"):
        return "N"
    if typename.startswith("float") or typename.startswith("{float"):
        return "NUMBER"
    return typename.upper()


class UsageError(Exception):
    """A flag argparse refused: unknown, misspelt, or missing its value (one line)."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's layout, up to 100 columns wide (a terminal's width when it is narrower)."""

    def __init__(self, prog: str) -> None:
        width = min(100, shutil.get_terminal_size((100, 24)).columns) - 2
        super().__init__(prog, max_help_position=36, width=width)


class ExporterParser(argparse.ArgumentParser):
    """The exporter's argparse parser, filled in by pydantic-settings' CLI source.

    Differences from a plain parser: a short usage; the common flags (:data:`COMMON_FLAGS`)
    in the first group of ``--help``; an error is :class:`UsageError` with one line that
    suggests the closest flag (``did you mean --listen?``), not the full usage; no
    abbreviated flags (``--series-ttl`` is not ``--series-ttl-seconds``), so that adding a
    flag never changes what an existing command line means.
    """

    def __init__(self) -> None:
        super().__init__(
            prog=PROG,
            usage=USAGE,
            description=inspect.cleandoc(Settings.__doc__ or ""),
            formatter_class=_HelpFormatter,
            add_help=False,
            allow_abbrev=False,
        )
        self.common = self.add_argument_group("common options")
        self.common.add_argument(
            "-h", "--help", action="help", default=argparse.SUPPRESS, help="show this help and exit"
        )
        self.common.add_argument(
            "--version", action="store_true", help="print the version and exit"
        )
        self.more = self.add_argument_group("more options")

    def place(self, context: Any, *names: str, **kwargs: Any) -> argparse.Action:
        """pydantic-settings' ``add_argument_method``: common flags first, the rest after.

        Also names each value by what it is (``SECONDS``, ``HOST:PORT``) rather than by its
        Python type, and drops pydantic-settings' "(default factory: ...)".
        """
        dest = str(kwargs.get("dest", "")).lower()
        if context is self:
            context = self.common if dest in COMMON_FLAGS else self.more
        if "metavar" in kwargs:
            kwargs["metavar"] = metavar(dest, str(kwargs["metavar"]))
        if "help" in kwargs:
            kwargs["help"] = re.sub(r" ?\(default factory: [^)]*\)", "", str(kwargs["help"]))
        return context.add_argument(*names, **kwargs)  # type: ignore[no-any-return]

    def flags(self) -> list[str]:
        """Every long flag the parser knows."""
        return [f for a in self._actions for f in a.option_strings if f.startswith("--")]

    def error(self, message: str) -> NoReturn:
        """Raise :class:`UsageError`: ``message``, a suggestion, and where the flags are listed."""
        typed = re.findall(r"(?<![\w-])(--?[\w.-]+)", message.split(":", 1)[-1])
        hint = ""
        for flag in typed:
            close = difflib.get_close_matches(flag.split("=", 1)[0], self.flags(), 1, 0.6)
            if close:
                hint = f"; did you mean {close[0]}?"
                break
        raise UsageError(f"{message}{hint} (see {PROG} --help)")

    def print_help(self, file: IO[str] | None = None) -> None:  # type: ignore[override]
        """Print the help; an unwritable stdout raises :class:`OutputError`.

        (argparse's own ``print_help`` ignores the error, and ``--help > /dev/full`` would
        print nothing and exit 0.)
        """
        if file is None or file is sys.stdout:
            _say(self.format_help().rstrip("\n"))
        else:
            super().print_help(file)


def load_settings(argv: Sequence[str]) -> Settings:
    """Settings from the environment (``TRAINMON_*``) overridden by CLI flags.

    Raises:
        pydantic.ValidationError: a value is invalid.
        UsageError: a flag is unknown or misspelt, or lacks its value.
        SystemExit: ``--help`` was given (code 0).
    """
    parser = ExporterParser()
    source: CliSettingsSource[Settings] = CliSettingsSource(
        Settings,
        root_parser=parser,
        cli_parse_args=list(argv),
        add_argument_method=parser.place,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return Settings(_cli_settings_source=source)


def _field_path(loc: Sequence[int | str]) -> tuple[list[str], FieldInfo | None]:
    """The setting names that start ``loc`` (``["analytics", "hang_factor"]``), and the field.

    The rest of ``loc``, if any, is a list index or a dict key within that setting.
    """
    names: list[str] = []
    model: Any = Settings
    field = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not isinstance(part, str) or not fields or part not in fields:
            break
        names.append(part)
        field = fields[part]
        model = field.annotation
    return names, field


def _given(names: list[str], argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """Where the value of setting ``names`` came from: the flag typed, or the variable set."""
    upper = {k.upper(): k for k in environ}
    for depth in range(len(names), 0, -1):  # --analytics.hang-factor, then --analytics JSON
        flag = "--" + ".".join(n.replace("_", "-") for n in names[:depth])
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            return flag
        var = "TRAINMON_" + "__".join(n.upper() for n in names[:depth])
        if var in upper:
            return f"{upper[var]} (environment)"
    flag = "--" + ".".join(n.replace("_", "-") for n in names)
    return f"{flag} / TRAINMON_{'__'.join(n.upper() for n in names)}"


UNITS = (
    ("_bytes_per_second", "bytes per second"),
    ("_seconds", "seconds"),
    ("_steps", "steps"),
    ("_checks", "checks"),
    ("_evals", "evaluations"),
    ("peak_flops", "FLOP/s"),
)
"""The unit a setting's value is in, from the end of its name."""


def _number(value: float) -> str:
    """``value`` as a bound is written: ``1073741824``, ``0.5``, ``1e+18``."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def expected(name: str, field: FieldInfo) -> str:
    """What a setting takes, in words: ``a number of seconds > 0 and <= 604800``."""
    kind = field.annotation
    words = {int: "a whole number", float: "a number", bool: "true or false"}
    what = next((w for t, w in words.items() if kind == t or kind == t | None), "")
    unit = next((u for suffix, u in UNITS if name.endswith(suffix)), None)
    if unit and what:
        what = f"{what} of {unit}"
    bounds = []
    for m in field.metadata:
        for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(m, attr, None) is not None:
                bounds.append(f"{op} {_number(getattr(m, attr))}")
    text = " ".join([what, " and ".join(bounds)]).strip()
    return f"expected {text}" if text else ""


def describe_error(err: Any, argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """One line for one pydantic error, naming the flag typed or the variable set.

    Then the value given, what is wrong, and what the setting takes:
    ``--series-ttl-seconds '10m': input should be a valid number, unable to parse string as
    a number; expected a number of seconds > 0 and <= 604800``
    """
    names, field = _field_path(err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:]
    kind = field.annotation if field is not None else None
    if not names or (isinstance(kind, type) and issubclass(kind, BaseModel)):
        return f"{' '.join([*names, 'settings'])}: {msg}"  # a check across several settings
    where = _given(names, argv, environ)
    rest = "".join(f"[{p!r}]" for p in err["loc"][len(names) :])
    value = err.get("input")
    shown = f" {value!r}" if isinstance(value, str | int | float) and not rest else ""
    if shown and shown.strip() in msg:
        shown = ""
    hint = expected(names[-1], field) if field is not None and not rest else ""
    return f"{where}{rest}{shown}: {msg}" + (f"; {hint}" if hint else "")


def describe_settings_error(
    exc: SettingsError, argv: Sequence[str], environ: Mapping[str, str]
) -> str:
    """One line for a value pydantic-settings could not even parse (a list that is not JSON).

    ``--step-duration-buckets: not valid JSON (Expecting value: line 1 column 2 (char 1))``
    """
    cause = f" ({exc.__cause__})" if exc.__cause__ else ""
    m = re.search(r'field "(\w+)" from source|encountered for ([\w.]+):', str(exc))
    if m is None:
        return f"{exc}{cause}"
    names = (m.group(1) or m.group(2)).split(".")
    return f"{_given(names, argv, environ)}: not valid JSON{cause}"


def exposure_warning(address: str, listen: str) -> str | None:
    """The line logged at start when HTTP listens beyond this host; None on loopback.

    ``address``: the bound address (``0.0.0.0``, ``::`` or one interface's); ``listen``: the
    setting as given. Not logged when a web configuration file sets basic auth; without it,
    whoever can reach the port reads everything the exporter serves.
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped and ip.ipv4_mapped.is_loopback):
        return None
    where = "every network interface" if ip.is_unspecified else f"{address}"
    return (
        f"HTTP listens on {listen} ({where}): every run's metrics, the status page and the JSON "
        "API are readable by anyone who can reach this port; limit it with a firewall or "
        "network policy, or set basic auth and TLS with --web-config-file"
    )


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
    """Run the exporter until SIGINT/SIGTERM. Returns the process exit code.

    0: stopped by SIGTERM (or ``--help``, ``--version``); 2: a start-up error, printed as one
    line on stderr (an unwritable stdout included); 130: SIGINT; 1: the server failed to start.
    """
    argv = sys.argv[1:] if argv is None else argv
    try:
        code = _main(argv)
        sys.stdout.flush()  # --help and --version: a full disk shows here
    except OutputError as exc:
        return _fail(str(exc)) if str(exc) else 2
    except OSError as exc:
        _silence(1)
        return _fail(_output_error(exc)) if _output_error(exc) else 2
    return code


def _main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "status":  # trainmon-exporter status: the terminal view
        from trainmon_exporter.views.terminal import main as status_main

        return status_main(argv[1:])
    if "--version" in argv:
        _say(f"{PROG} {__version__}")
        return 0
    try:
        settings = load_settings(argv)
    except SystemExit as exc:  # --help printed
        return exc.code if isinstance(exc.code, int) else 2
    except UsageError as exc:
        return _fail(str(exc))
    except ValidationError as exc:
        for err in exc.errors():
            _fail(describe_error(err, argv, os.environ))
        return 2
    except SettingsError as exc:  # e.g. a list-valued variable that is not JSON
        return _fail(describe_settings_error(exc, argv, os.environ))
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
        return _fail("; ".join([str(exc), *socket_notes(settings.socket)]))
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
    from trainmon_exporter.webconfig import TlsReloader, WebConfigError, load_web_config

    try:  # TLS and basic auth (--web.config.file): a bad file or certificate stops here
        web = load_web_config(settings.web_config_file) if settings.web_config_file else None
        app = create_app(settings, listener=listener, web=web)
        reloader = None
        if web is not None and web.tls_server_config is not None:
            # The certificate is read again when its files change (a renewal needs no restart).
            reloader = TlsReloader(web.tls_server_config, app.state.exporter.tls_stats)
        tls = reloader.server_context if reloader is not None else None
    except WebConfigError as exc:
        return _fail(str(exc))
    if web is None or not web.basic_auth_users:
        exposure = exposure_warning(http_sock.getsockname()[0], settings.listen)
        if exposure:
            logging.getLogger("trainmon_exporter").warning("%s", exposure)
    if tls is not None:
        # asyncio gives a TLS handshake 60 s, during which the connection is not yet uvicorn's
        # (no limit_concurrency, no eviction): the header timeout bounds the handshake too.
        # uvicorn has no setting for it; asyncio reads this constant at each connection.
        asyncio.constants.SSL_HANDSHAKE_TIMEOUT = settings.http_header_timeout_seconds
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
    notes = socket_notes(settings.socket)  # the default went elsewhere than /run/trainmon
    _say(
        f"{PROG} {__version__}: metrics on {scheme}://{host}:{port}/metrics, status page "
        f"{scheme}://{host}:{port}/, trainers connect to {settings.socket}"
        + (f" ({'; '.join(notes)})" if notes else "")
    )
    try:
        server.run(sockets=[http_sock])
    except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its clean shutdown
        return 130
    return 0 if server.started else 1
