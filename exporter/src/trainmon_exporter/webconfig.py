"""The web configuration file (``--web.config.file``): TLS and basic auth on the HTTP port.

The file has the format of the Prometheus exporter toolkit's web configuration (the one
node_exporter and Prometheus read), so an existing file can be reused::

    tls_server_config:
      cert_file: /etc/trainmon/tls.crt
      key_file: /etc/trainmon/tls.key
    basic_auth_users:
      prometheus: $2y$10$...   # bcrypt hash

What trainmon supports of that format: ``tls_server_config`` (``cert_file``, ``key_file``,
``client_auth_type`` ``NoClientCert``, ``VerifyClientCertIfGiven`` or
``RequireAndVerifyClientCert`` with ``client_ca_file``, ``min_version``, ``max_version``,
``prefer_server_cipher_suites``), ``http_server_config`` (``headers``; ``http2`` is accepted
and has no effect: the exporter speaks HTTP/1.1) and ``basic_auth_users``. Any other key is an
error at start, named, so a file never loses a protection silently. The file is read once at
start (the toolkit re-reads it on every request): restart the exporter to apply a change. The
certificate, key and client CA it names are read again when they change
(:class:`TlsReloader`, checked at each TLS handshake), so a renewal needs no restart.

Basic auth covers every route, ``/healthz`` and ``/readyz`` included, as in the toolkit. A
bcrypt check costs about 0.1 s of CPU at cost 10, so it runs in a worker thread, at most
``http_max_concurrent_auth_checks`` at once, shared fairly between client addresses (one check
in progress or waiting per address, a second one gets 503 at once; the others wait their turn
in arrival order), and a user's last verified password is kept as its SHA-256 digest: a
scraper sending the same credentials every 15 s pays for bcrypt once, its later requests cost
one constant-time digest comparison. The cache holds one entry per configured user, so it is
bounded by the file. Every refused request is counted in
``trainmon_http_auth_failures_total{reason}``.

Why this module is one module of about 500 lines: it is everything the file turns on (the
format's models with their refusals, the TLS context, the basic auth and headers middleware),
so what trainmon supports of the format is read in one place; most of it is validation.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import ssl
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import anyio.to_thread
import bcrypt
import yaml  # type: ignore[import-untyped]
from prometheus_client.metrics_core import Metric
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trainmon_exporter import catalog

log = logging.getLogger("trainmon_exporter.http")

AUTH_FAILURE_REASONS = ("missing", "malformed", "rejected", "check_limit")
"""``reason`` values of ``trainmon_http_auth_failures_total``: no Basic credentials, credentials
that do not decode, an unknown user or a wrong password (both 401), and a password check
refused with 503 because the client's address already had one in progress or waiting."""

BCRYPT_HASH = re.compile(r"\$2[abxy]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
"""A bcrypt hash as htpasswd -B and Python's bcrypt write it: ``$2y$10$`` and 53 characters."""
BCRYPT_MAX_PASSWORD_BYTES = 72
"""bcrypt reads only this many bytes; a longer password is refused without a check (as Go's
bcrypt does), which also keeps a flood of long passwords cheap."""
REALM = 'Basic realm="trainmon", charset="UTF-8"'

TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
TlsVersion = Literal["TLS10", "TLS11", "TLS12", "TLS13"]

_UNSUPPORTED_TLS = {
    "cert": "give the certificate as cert_file",
    "key": "give the key as key_file",
    "client_ca": "give the client CA as client_ca_file",
    "client_allowed_sans": "restrict clients with client_ca_file instead",
    "cipher_suites": "Go cipher suite names have no OpenSSL equivalent here; leave it out "
    "to use OpenSSL's defaults",
    "curve_preferences": "leave it out to use OpenSSL's defaults",
}
_UNVERIFIED_CLIENT_AUTH = {
    "RequestClientCert": "it accepts a client certificate without verifying it",
    "RequireAnyClientCert": "it accepts a client certificate without verifying it",
}


class WebConfigError(ValueError):
    """The web configuration file is unreadable or invalid, or its certificate does not load.

    The message is one line for the user.
    """


def _refuse_unsupported(data: Any, unsupported: dict[str, str]) -> Any:
    if isinstance(data, dict):
        for key, hint in unsupported.items():
            if key in data:
                raise ValueError(f"{key} is not supported by trainmon: {hint}")
    return data


class TlsServerConfig(BaseModel):
    """``tls_server_config``: the server's certificate, client certificates, TLS versions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cert_file: Path = Field(description="PEM certificate (chain) the server presents")
    key_file: Path = Field(description="PEM private key of cert_file")
    client_auth_type: Literal[
        "NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert"
    ] = Field("NoClientCert", description="whether clients must present a certificate")
    client_ca_file: Path | None = Field(None, description="PEM CA(s) client certificates chain to")
    min_version: TlsVersion = "TLS12"
    max_version: TlsVersion = "TLS13"
    prefer_server_cipher_suites: bool = True

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _refuse_unsupported(data, _UNSUPPORTED_TLS)

    @field_validator("client_auth_type", mode="before")
    @classmethod
    def _verified_only(cls, value: Any) -> Any:
        if value in _UNVERIFIED_CLIENT_AUTH:
            raise ValueError(
                f"{value} is not supported: {_UNVERIFIED_CLIENT_AUTH[value]}; use "
                "RequireAndVerifyClientCert (or VerifyClientCertIfGiven) with client_ca_file"
            )
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TlsServerConfig:
        if self.client_auth_type != "NoClientCert" and self.client_ca_file is None:
            raise ValueError(f"client_auth_type {self.client_auth_type} needs client_ca_file")
        if self.client_auth_type == "NoClientCert" and self.client_ca_file is not None:
            raise ValueError(
                "client_ca_file is set but client_auth_type is NoClientCert: set "
                "client_auth_type to RequireAndVerifyClientCert to check client certificates"
            )
        if TLS_VERSIONS[self.min_version] > TLS_VERSIONS[self.max_version]:
            raise ValueError(f"min_version {self.min_version} is above max_version")
        return self

    def ssl_context(self) -> ssl.SSLContext:
        """A server ``SSLContext`` with the certificate, key and client policy loaded.

        :func:`load_web_config` has made relative paths relative to the file's directory.

        Raises:
            WebConfigError: a file is missing or unreadable, is not PEM, or the key does not
                belong to the certificate (one line naming the file).
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = TLS_VERSIONS[self.min_version]
        ctx.maximum_version = TLS_VERSIONS[self.max_version]
        if self.prefer_server_cipher_suites:
            ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        else:
            ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
        files = f"cert_file {self.cert_file}, key_file {self.key_file}"
        for path in (self.cert_file, self.key_file):
            _readable(path)
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as exc:
            raise WebConfigError(f"tls_server_config: {files}: {_ssl_reason(exc)}") from None
        if self.client_ca_file is not None:
            _readable(self.client_ca_file)
            try:
                ctx.load_verify_locations(cafile=self.client_ca_file)
            except ssl.SSLError as exc:
                raise WebConfigError(
                    f"tls_server_config: client_ca_file {self.client_ca_file}: {_ssl_reason(exc)}"
                ) from None
            ctx.verify_mode = (
                ssl.CERT_REQUIRED
                if self.client_auth_type == "RequireAndVerifyClientCert"
                else ssl.CERT_OPTIONAL
            )
        return ctx


def _readable(path: Path) -> None:
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise WebConfigError(f"tls_server_config: {path}: {exc.strerror}") from None


def _ssl_reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason (``KEY_VALUES_MISMATCH``...) in words, not ``[SSL] PEM lib``."""
    reason = exc.reason or str(exc)
    if reason in ("PEM_LIB", "NO_START_LINE") or "PEM lib" in str(exc):
        return "not a PEM certificate and matching private key"
    return reason.replace("_", " ").lower()


class ResponseHeaders(BaseModel):
    """``http_server_config.headers``: security headers added to every response."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    content_security_policy: str | None = Field(None, alias="Content-Security-Policy")
    x_frame_options: str | None = Field(None, alias="X-Frame-Options")
    x_content_type_options: str | None = Field(None, alias="X-Content-Type-Options")
    x_xss_protection: str | None = Field(None, alias="X-XSS-Protection")
    strict_transport_security: str | None = Field(None, alias="Strict-Transport-Security")

    @field_validator("x_frame_options")
    @classmethod
    def _frame(cls, value: str | None) -> str | None:
        if value and value.lower() not in ("deny", "sameorigin"):
            raise ValueError("X-Frame-Options must be deny or sameorigin")
        return value

    @field_validator("x_content_type_options")
    @classmethod
    def _nosniff(cls, value: str | None) -> str | None:
        if value and value.lower() != "nosniff":
            raise ValueError("X-Content-Type-Options must be nosniff")
        return value

    def pairs(self) -> list[tuple[bytes, bytes]]:
        """The headers that are set (not blank), as ASGI header pairs."""
        return [
            (name.lower().encode("latin-1"), value.encode("latin-1"))
            for name, value in self.model_dump(by_alias=True).items()
            if value
        ]


class HttpServerConfig(BaseModel):
    """``http_server_config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    http2: bool = Field(True, description="accepted for compatibility; HTTP/1.1 is served")
    headers: ResponseHeaders = ResponseHeaders()


class WebConfig(BaseModel):
    """The whole file. An empty file is valid: plain HTTP, no authentication."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tls_server_config: TlsServerConfig | None = None
    http_server_config: HttpServerConfig = HttpServerConfig()
    basic_auth_users: dict[str, SecretStr] = Field(
        default_factory=dict, description="user name -> bcrypt hash of the password"
    )

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _refuse_unsupported(
            data, {"rate_limit": "bound requests with http_limit_concurrency instead"}
        )

    @field_validator("basic_auth_users")
    @classmethod
    def _hashes(cls, users: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for user, secret in users.items():
            if not user or ":" in user:
                raise ValueError(f"user {user!r}: a user name is not empty and has no ':'")
            if not BCRYPT_HASH.fullmatch(secret.get_secret_value()):
                raise ValueError(
                    f"user {user!r}: the password must be a bcrypt hash ($2y$10$ and 53 "
                    "characters; htpasswd -nBC 10 USER makes one), not the password itself"
                )
        return users

    def ssl_context(self) -> ssl.SSLContext | None:
        """The server's TLS context, or None without ``tls_server_config`` (plain HTTP).

        Raises:
            WebConfigError: see :meth:`TlsServerConfig.ssl_context`.
        """
        return None if self.tls_server_config is None else self.tls_server_config.ssl_context()


def load_web_config(path: str | Path) -> WebConfig:
    """Read and validate the web configuration file at ``path`` (YAML).

    Relative ``cert_file``, ``key_file`` and ``client_ca_file`` paths are taken relative to
    the file's own directory, as the exporter toolkit does.

    Raises:
        WebConfigError: the file is unreadable, not YAML, not a mapping, or invalid; the
            message names the file and every invalid key on one line.
    """
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise WebConfigError(f"web config {path}: {reason}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise WebConfigError(f"web config {path}: not YAML{line}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise WebConfigError(f"web config {path}: expected a mapping of sections")
    try:
        web = WebConfig.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            problems.append(f"{where}: {msg}" if where else msg)
        raise WebConfigError(f"web config {path}: {'; '.join(problems)}") from None
    tls = web.tls_server_config
    if tls is None:
        return web
    base = Path(path).parent
    files = {
        name: base / value
        for name in ("cert_file", "key_file", "client_ca_file")
        if (value := getattr(tls, name)) is not None and not value.is_absolute()
    }
    return web.model_copy(update={"tls_server_config": tls.model_copy(update=files)})


TLS_RELOAD_RESULTS = ("success", "failure")
"""``result`` values of ``trainmon_http_tls_reloads_total``."""


class _Counts:
    """Counts by the value of one label (thread-safe), exported by :meth:`collect`."""

    def __init__(self, family: catalog.Family, values: tuple[str, ...]) -> None:
        self._family = family
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(values, 0)

    def _add(self, value: str) -> None:
        with self._lock:
            self.counts[value] += 1

    def collect(self) -> Iterable[Metric]:
        """The family, every value from 0 (also where the feature is off)."""
        family = self._family.counter()
        with self._lock:
            for value, n in self.counts.items():
                family.add_metric([value], float(n))
        return [family]


class TlsStats(_Counts):
    """``trainmon_http_tls_reloads_total``: certificate reloads by result."""

    def __init__(self) -> None:
        super().__init__(catalog.HTTP_TLS_RELOADS, TLS_RELOAD_RESULTS)

    def reloaded(self, result: str) -> None:
        """Count one reload that ended in ``result``."""
        self._add(result)


FileState = tuple[int, int, int, int] | str
"""What :class:`TlsReloader` compares to tell that a file changed: device, inode, size and
modification time in ns (of the file a symbolic link leads to), or the error of ``stat``."""


class TlsReloader:
    """The server's TLS context, made again when its certificate, key or client CA change.

    Certificates are renewed under a running exporter (cert-manager rewrites a Secret, the
    kubelet swaps the mounted files; certbot writes new ones). At each TLS handshake, in the
    server's ``sni_callback`` (OpenSSL calls it for every client hello, with or without SNI),
    the files are checked with ``stat`` (a few microseconds, against a millisecond of
    handshake); when one changed they are loaded into a new context, and this handshake and
    every later one use it. Connections already open keep theirs. Files that do not load
    (missing, not PEM, a key of another certificate: e.g. a renewal caught between writing
    the certificate and the key) leave the previous context in use, are logged and counted,
    and are tried again when they next change. The exporter toolkit reads the files at every
    handshake instead; checking that they changed gives the same result without parsing PEM
    on every connection.

    Args:
        config: the ``tls_server_config`` (paths already made absolute).
        stats: where reloads are counted.

    Raises:
        WebConfigError: the files do not load at start (see
            :meth:`TlsServerConfig.ssl_context`).
    """

    def __init__(self, config: TlsServerConfig, stats: TlsStats | None = None) -> None:
        self.config = config
        self.stats = stats if stats is not None else TlsStats()
        self._files = [config.cert_file, config.key_file]
        if config.client_ca_file is not None:
            self._files.append(config.client_ca_file)
        self._seen = self._state()  # before loading: a change during the load is seen later
        self.context = config.ssl_context()
        """The context handshakes use now (the last that loaded)."""
        self.server_context = self.context
        """The context to give the server; its ``sni_callback`` switches each connection to
        :attr:`context`."""
        self.server_context.sni_callback = self._on_client_hello

    def _state(self) -> list[FileState]:
        out: list[FileState] = []
        for path in self._files:
            try:
                st = os.stat(path)
            except OSError as exc:
                out.append(exc.strerror or str(exc))
            else:
                out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        return out

    def check(self) -> bool:
        """Load the files again if they changed since last seen; True when a new context loaded.

        Never raises: a failure is logged and counted, and the previous context stays.
        """
        state = self._state()
        if state == self._seen:
            return False
        self._seen = state
        try:
            context = self.config.ssl_context()
        except WebConfigError as exc:
            self.stats.reloaded("failure")
            log.error(
                "TLS files changed but do not load; still serving the previous certificate: %s", exc
            )
            return False
        self.context = context
        self.stats.reloaded("success")
        log.info("TLS certificate reloaded from %s", self.config.cert_file)
        return True

    def _on_client_hello(
        self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: Any
    ) -> None:
        try:
            self.check()
            if self.context is not self.server_context:
                connection.context = self.context
        except Exception:  # an exception here would fail the handshake
            log.exception("TLS certificate reload failed")


class AuthStats(_Counts):
    """``trainmon_http_auth_failures_total``: refused requests by reason."""

    def __init__(self) -> None:
        super().__init__(catalog.HTTP_AUTH_FAILURES, AUTH_FAILURE_REASONS)
        self.failures = self.counts

    def fail(self, reason: str) -> None:
        """Count one request refused for ``reason``."""
        self._add(reason)


class BasicAuth:
    """Checks ``Authorization: Basic`` credentials against bcrypt hashes.

    Password checks are shared fairly between clients: each client address (an IPv6 one by
    its /64, as one host holds them all) has at most one check in progress or waiting, and
    checks past ``max_checks`` wait their turn in arrival order. A flood of wrong passwords
    from one address therefore holds at most one check, and another client's password is
    checked at once, or after the checks ahead of it (one per flooding address, each about
    0.1 s at cost 10): right after a restart, before any password is known, the right one
    gets in during a flood. How long a check may wait is bounded by the connections that can
    wait (``http_limit_concurrency``).

    Args:
        users: user name -> bcrypt hash.
        stats: where refusals are counted.
        max_checks: bcrypt checks in progress at once; more wait their turn.
    """

    def __init__(self, users: dict[str, bytes], stats: AuthStats, max_checks: int) -> None:
        self._users = dict(users)
        self._verified: dict[str, bytes] = {}  # user -> SHA-256 of its last verified password
        # An unknown user is checked against a real hash, so it takes as long as a known one.
        self._decoy = next(iter(self._users.values()))
        self.stats = stats
        self.max_checks = max_checks
        self.checks = 0  # bcrypt checks in progress (event-loop thread only)
        self._clients: set[str] = set()  # client addresses with a check in progress or waiting
        self._turns: collections.deque[asyncio.Future[None]] = collections.deque()

    async def check(self, header: bytes | None, client: str | None = None) -> str | None:
        """None when ``header`` (the raw Authorization value) holds valid credentials.

        ``client``: the client's address (the ASGI scope's ``client`` host), which decides
        whose turn a password check is. Else the reason of the refusal (counted), one of
        :data:`AUTH_FAILURE_REASONS`: ``check_limit`` when this client already has a check
        in progress or waiting.
        """
        reason = await self._check(header, client_key(client))
        if reason is not None:
            self.stats.fail(reason)
        return reason

    async def _check(self, header: bytes | None, client: str) -> str | None:
        if header is None or header[:6].lower() != b"basic ":
            return "missing"
        try:
            raw = base64.b64decode(header[6:].strip(), validate=True)
        except (binascii.Error, ValueError):
            return "malformed"
        user_bytes, sep, password = raw.partition(b":")
        if not sep:
            return "malformed"
        try:
            user = user_bytes.decode()
        except UnicodeDecodeError:
            return "malformed"
        if len(password) > BCRYPT_MAX_PASSWORD_BYTES:
            return "rejected"
        digest = hashlib.sha256(password).digest()
        known = self._verified.get(user)
        if known is not None and hmac.compare_digest(known, digest):
            return None
        if client in self._clients:
            return "check_limit"
        stored = self._users.get(user)
        self._clients.add(client)
        try:
            await self._take_turn()
            try:
                ok = await anyio.to_thread.run_sync(
                    _checkpw, password, stored if stored is not None else self._decoy
                )
            finally:
                self._give_turn()
        finally:
            self._clients.discard(client)
        if not ok or stored is None:
            return "rejected"
        self._verified[user] = digest
        return None

    async def _take_turn(self) -> None:
        """Wait until one of the ``max_checks`` checks is this caller's."""
        if self.checks < self.max_checks and not self._turns:
            self.checks += 1
            return
        turn = asyncio.get_running_loop().create_future()
        self._turns.append(turn)
        try:
            await turn  # _give_turn hands a check over: self.checks already counts it
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._give_turn()  # it was handed over just now: pass it on
            else:
                self._turns.remove(turn)
            raise

    def _give_turn(self) -> None:
        """A check ended: the next waiting caller's starts, else one fewer is in progress."""
        while self._turns:
            turn = self._turns.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.checks -= 1


def client_key(host: str | None) -> str:
    """Whose turn a password check is: the client's address, an IPv6 one by its /64.

    A host gets a /64 to itself (or more), so counting IPv6 addresses one by one would let
    one host take every turn. ``""`` when the server gave no address.
    """
    if not host:
        return ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _checkpw(password: bytes, hashed: bytes) -> bool:
    """The bcrypt check; False (and logged) for a hash bcrypt refuses though it looked valid."""
    try:
        return bool(bcrypt.checkpw(password, hashed))
    except ValueError as exc:
        log.error("basic_auth_users: bcrypt refuses a configured hash: %s", exc)
        return False


class WebMiddleware:
    """ASGI middleware: basic auth on every HTTP request, and the configured response headers.

    A refused request gets 401 with ``WWW-Authenticate`` (503 with ``Retry-After`` when too
    many password checks are in progress) and never reaches a route.
    """

    def __init__(
        self, app: ASGIApp, auth: BasicAuth | None, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self.app = app
        self.auth = auth
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse the request, or pass it on with the headers added to its response."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.headers:
            send = self._with_headers(send)
        if self.auth is not None:
            value = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            client = scope.get("client")
            reason = await self.auth.check(value, client[0] if client else None)
            if reason is not None:
                await _refuse(send, reason)
                return
        await self.app(scope, receive, send)

    def _with_headers(self, send: Send) -> Send:
        extra = self.headers

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        return wrapped


async def _refuse(send: Send, reason: str) -> None:
    if reason == "check_limit":
        status, body = 503, b"too many password checks in progress\n"
        headers = [(b"retry-after", b"1")]
    else:
        status, body = 401, b"unauthorized\n"
        headers = [(b"www-authenticate", REALM.encode())]
    headers += [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def middleware_options(web: WebConfig, stats: AuthStats, max_checks: int) -> dict[str, Any]:
    """Keyword arguments of :class:`WebMiddleware` for ``web``; ``{}`` without users or headers."""
    headers = web.http_server_config.headers.pairs()
    if not web.basic_auth_users and not headers:
        return {}
    auth = None
    if web.basic_auth_users:
        if web.tls_server_config is None:
            log.warning(
                "basic_auth_users without tls_server_config: passwords cross the network in "
                "clear text; add tls_server_config"
            )
        users = {u: h.get_secret_value().encode() for u, h in web.basic_auth_users.items()}
        auth = BasicAuth(users, stats, max_checks)
    return {"auth": auth, "headers": headers}
