"""Reading a running exporter's JSON API over HTTP or HTTPS, for ``trainmon status``.

An exporter with a web configuration file is read over HTTPS (a private CA from
``--ca-file``) with basic auth (``--user``; the password from ``TRAINMON_STATUS_PASSWORD`` or
``--password-file``, never a flag: other users can read a command line). Answers are parsed
into the API's own models (:mod:`trainmon_exporter.views.api`); every failure is one
:class:`StatusError` line with control characters escaped.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from trainmon_exporter._defaults import DEFAULT_PORT
from trainmon_exporter.views.api import GpusResponse, RunsResponse
from trainmon_exporter.views.cells import printable

DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
PASSWORD_VARIABLE = "TRAINMON_STATUS_PASSWORD"


class StatusError(RuntimeError):
    """The exporter could not be read (one line for the user)."""


_Body = TypeVar("_Body", bound=BaseModel)


class Access(NamedTuple):
    """How to reach an exporter with a web configuration file: TLS trust and credentials."""

    context: ssl.SSLContext | None = None
    authorization: str | None = None  # the Authorization header's value


PLAIN = Access()
"""System CAs, no credentials."""


def _get(url: str, path: str, model: type[_Body], timeout: float, access: Access) -> _Body:
    headers = {} if access.authorization is None else {"Authorization": access.authorization}
    request = urllib.request.Request(url.rstrip("/") + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=access.context) as r:
            body = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(exc, urllib.error.HTTPError) and exc.code == 401:
            reason = f"401 {reason}: give --user, and the password in {PASSWORD_VARIABLE}"
        raise StatusError(printable(f"cannot read {url}{path}: {reason}")) from None
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise StatusError(
            printable(
                f"cannot read {url}{path}: not a trainmon exporter's answer "
                f"({where}: {first['msg']})"
            )
        ) from None


def fetch(
    url: str, timeout: float = 5.0, access: Access = PLAIN
) -> tuple[RunsResponse, GpusResponse]:
    """``(runs, gpus)``: the bodies of ``/api/v1/runs`` and ``/api/v1/gpus``, parsed.

    Raises:
        StatusError: the exporter is unreachable, answered with an error, or its answer does
            not fit the API's models.
    """
    runs = _get(url, "/api/v1/runs", RunsResponse, timeout, access)
    return runs, _get(url, "/api/v1/gpus", GpusResponse, timeout, access)


def normalise_url(url: str) -> str:
    """``url`` with ``http://`` added when it has no scheme (``host:port`` is accepted).

    Raises:
        StatusError: a scheme other than http/https, or no host.
    """
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise StatusError(f"--url {url}: only http:// and https:// are supported")
    if not parts.hostname:
        raise StatusError(f"--url {url}: no host (expected HOST:PORT or http://HOST:PORT)")
    return url.rstrip("/")


def access_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Access:
    """TLS trust and credentials from ``--ca-file``, ``--user`` and the password.

    Raises:
        StatusError: the CA or password file cannot be read, or a user has no password.
    """
    environ = dict(os.environ) if environ is None else environ
    context = None
    if args.ca_file:
        try:
            context = ssl.create_default_context(cafile=args.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise StatusError(f"--ca-file {args.ca_file}: {exc.strerror or exc}") from None
    if args.user is None:
        return Access(context)
    if args.password_file:
        try:
            with open(args.password_file, encoding="utf-8") as f:
                password = f.read().rstrip("\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise StatusError(f"--password-file {args.password_file}: {exc}") from None
    elif PASSWORD_VARIABLE in environ:
        password = environ[PASSWORD_VARIABLE]
    else:
        raise StatusError(f"--user needs a password: set {PASSWORD_VARIABLE} or --password-file")
    token = base64.b64encode(f"{args.user}:{password}".encode()).decode()
    return Access(context, f"Basic {token}")
