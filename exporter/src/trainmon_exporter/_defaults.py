"""Defaults that parts without the settings model need (the settings module re-exports them).

``trainmon status`` reads the exporter's default address from here: importing
:mod:`trainmon_exporter.settings` would load pydantic-settings, which the terminal has no use for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from trainmon_client import _env

log = logging.getLogger("trainmon_exporter")
_noticed: set[str] = set()

DEFAULT_PORT = 9478
"""The exporter's HTTP port (``--listen`` default ``127.0.0.1:9478``)."""


def default_socket(env: Mapping[str, str] | None = None, euid: int | None = None) -> str:
    """The exporter's socket path when neither ``--socket`` nor ``TRAINMON_SOCKET`` gives one.

    1. ``/run/trainmon/trainmon.sock`` for root, and for a user who may create a socket in
       ``/run/trainmon`` (it exists, writable and searchable: a service's
       ``RuntimeDirectory``, a directory an admin made for a group);
    2. else ``$XDG_RUNTIME_DIR/trainmon/trainmon.sock`` (a login session's runtime directory);
       when ``/run/trainmon`` exists but is not this user's to use (an admin's set-up, a
       container recipe run once), one notice on the log says so and where it listens instead;
    3. else ``/run/trainmon/trainmon.sock`` (the socket check then says what to pass).

    A trainer's default (:func:`trainmon_client._env.default_socket`) finds it: a socket in
    ``/run/trainmon`` it may connect to, else the same runtime directory.

    Args:
        env: the environment to read (default ``os.environ``).
        euid: the effective uid (default ``os.geteuid()``); permissions are the process's own.
    """
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    system = _env.DEFAULT_SOCKET
    directory = os.path.dirname(system)
    if euid == 0 or _env.can_create_in(directory):
        return system
    runtime = _env.runtime_socket(env)
    if runtime is None:
        return system
    if os.path.isdir(directory):
        notice = _env.fallback_notice("exporter", runtime)
        if notice not in _noticed:
            _noticed.add(notice)
            log.warning("%s", notice)
    return runtime
