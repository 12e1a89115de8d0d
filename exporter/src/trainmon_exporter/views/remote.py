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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from trainmon_exporter._defaults import DEFAULT_PORT
from trainmon_exporter.views.api import GpusResponse, RunsResponse, RunView
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
    return access(args.ca_file, args.user, args.password_file, environ)


def access(
    ca_file: str | os.PathLike[str] | None,
    user: str | None,
    password_file: str | os.PathLike[str] | None,
    environ: dict[str, str] | None = None,
) -> Access:
    """TLS trust from ``ca_file``, and basic auth as ``user`` (``trainmon status``, peers).

    The password is read from ``password_file``, else :data:`PASSWORD_VARIABLE`.

    Raises:
        StatusError: the CA or password file cannot be read, or a user has no password.
    """
    environ = dict(os.environ) if environ is None else environ
    context = None
    if ca_file:
        try:
            context = ssl.create_default_context(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise StatusError(f"--ca-file {ca_file}: {exc.strerror or exc}") from None
    if user is None:
        return Access(context)
    if password_file:
        try:
            with open(password_file, encoding="utf-8") as f:
                password = f.read().rstrip("\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise StatusError(f"--password-file {password_file}: {exc}") from None
    elif PASSWORD_VARIABLE in environ:
        password = environ[PASSWORD_VARIABLE]
    else:
        raise StatusError(f"--user needs a password: set {PASSWORD_VARIABLE} or --password-file")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    return Access(context, f"Basic {token}")


def fetch_runs(url: str, timeout: float = 5.0, access: Access = PLAIN) -> RunsResponse:
    """The body of ``/api/v1/runs``, parsed (raises :class:`StatusError` as :func:`fetch`)."""
    return _get(url, "/api/v1/runs", RunsResponse, timeout, access)


PEER_TIMEOUT_S = 2.0
"""Seconds the status page waits for each of its peers (read in parallel)."""


def with_peers(
    local: RunsResponse, peers: Sequence[str], access: Access, timeout: float = PEER_TIMEOUT_S
) -> tuple[list[RunView], list[str]]:
    """The runs of ``local`` that have hang evidence, with their ranks on ``peers`` merged in.

    Peers are read only when a local run has evidence, in parallel, each within ``timeout``;
    only runs that have ranks in ``local`` are taken from them. Returns the merged runs and
    one line per peer that could not be read.
    """
    from trainmon_exporter.views.hangs import merge_runs

    mine = RunsResponse(time=local.time, runs=[r for r in local.runs if r.hang is not None])
    if not mine.runs or not peers:
        return merge_runs([mine]), []
    problems: list[str] = []
    answers = [mine]
    with ThreadPoolExecutor(max_workers=min(16, len(peers))) as pool:
        futures = [pool.submit(fetch_runs, url, timeout, access) for url in peers]
        for url, future in zip(peers, futures, strict=True):
            try:
                answers.append(future.result())
            except StatusError as exc:
                problems.append(f"status peer {printable(url)}: {exc}")
    return merge_runs(answers, only=mine), problems
