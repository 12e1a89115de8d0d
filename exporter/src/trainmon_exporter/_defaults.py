"""Defaults that parts without the settings model need (the settings module re-exports them).

``trainmon status`` reads the exporter's default address from here: importing
:mod:`trainmon_exporter.settings` would load pydantic-settings, which the terminal has no use for.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from trainmon_client import _env

DEFAULT_PORT = 9478
"""The exporter's HTTP port (``--listen`` default ``127.0.0.1:9478``)."""


def default_socket(env: Mapping[str, str] | None = None, euid: int | None = None) -> str:
    """The exporter's socket path when neither ``--socket`` nor ``TRAINMON_SOCKET`` gives one.

    1. ``/run/trainmon/trainmon.sock`` for root, and for a user who may create a socket in
       ``/run/trainmon`` (it exists, writable and searchable: a service's
       ``RuntimeDirectory``, a directory an admin made for a group);
    2. else ``$XDG_RUNTIME_DIR/trainmon/trainmon.sock`` where that directory is this user's
       own (:func:`trainmon_client._env.runtime_dir_problem`);
    3. else ``/run/trainmon/trainmon.sock`` (the socket check then says what to pass).

    Nothing is printed here: settings are built before anything else is checked, and a
    notice printed then would come before every error. :func:`socket_notes` says what a user
    needs to know about the pick, once the exporter starts or its socket fails.

    A trainer's default (:func:`trainmon_client._env.default_socket`) finds it: a socket in
    ``/run/trainmon`` it may connect to, else the same runtime directory.

    Args:
        env: the environment to read (default ``os.environ``).
        euid: the effective uid (default ``os.geteuid()``); permissions are the process's own.
    """
    return _env.choose_socket("exporter", env, euid).path


def socket_notes(path: os.PathLike[str] | str, env: Mapping[str, str] | None = None) -> list[str]:
    """What a user should know about ``path`` as the exporter's default socket, or nothing.

    Empty unless ``path`` is the default the rule picks now (a path given with ``--socket``
    or ``TRAINMON_SOCKET`` needs no word). Else: why ``$XDG_RUNTIME_DIR`` was not trusted,
    and why not ``/run/trainmon`` where it exists, with what trainers that do not share
    this login's runtime directory (a batch job, another user) must set.
    """
    choice = _env.choose_socket("exporter", env)
    if os.fspath(path) != choice.path:
        return []
    notes = [choice.distrust] if choice.distrust else []
    if choice.fallback:
        notes.append(
            f"not {os.path.dirname(_env.DEFAULT_SOCKET)}: {choice.fallback}; trainers "
            f"without this $XDG_RUNTIME_DIR set TRAINMON_SOCKET={choice.path}"
        )
    return notes
