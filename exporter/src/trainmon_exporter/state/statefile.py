"""The exporter's state file: where its durable records live on disk, read and written safely.

One JSON object, written by the exporter alone::

    {"format": "trainmon-exporter-state", "version": 1, "saved_at": <Unix s>,
     "exporter": "<version>", "ranks": [<row>, ...], "departed": [<row>, ...]}

The rows are :mod:`trainmon_exporter.state.ledger`'s. Written atomically: a new file beside
it (``mkstemp``, mode 0600), written, ``fsync``-ed, renamed over the old one, and the directory
``fsync``-ed, so a crash at any instant leaves the old file or the new one, never half of
either. Bounded: at most :data:`MAX_STATE_BYTES` (the rows are bounded by the store's rank cap
and the ledger's).

Read without trusting the path: opened ``O_NOFOLLOW | O_NONBLOCK`` and judged on its
descriptor: a regular file of root or this exporter's user, writable by no one else, at most
:data:`MAX_STATE_BYTES`. Anything else is refused with a :class:`StateFileError` whose
``reason`` is one of :data:`REFUSALS` and whose message says what to do; the caller logs it,
counts it and goes on without the file's records (it never stops the exporter).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from trainmon_exporter.analytics import RankAnalytics
from trainmon_exporter.state.ledger import Departed
from trainmon_exporter.state.rank import tenant_of
from trainmon_exporter.state.records import (
    Row,
    departed_row,
    parse_row,
    rank_row,
    restored_state,
)
from trainmon_exporter.state.store import Store

__all__ = [
    "FORMAT",
    "MAX_STATE_BYTES",
    "REFUSALS",
    "VERSION",
    "Keeper",
    "StateFileError",
    "read",
    "set_aside",
    "write",
]

FORMAT: Final = "trainmon-exporter-state"
"""The ``format`` of a trainmon exporter's state file."""
VERSION: Final = 1
"""The layout this exporter writes and reads; a later one is refused (``future_version``)."""
MAX_STATE_BYTES: Final = 64 * 2**20
"""Largest state file read or written (bytes)."""
REFUSALS: Final = ("unsafe", "too_large", "corrupt", "foreign", "future_version", "unreadable")
"""Why a state file is refused: another user could have written it (or it is a symbolic link
or not a regular file); larger than :data:`MAX_STATE_BYTES`; not JSON or a row that fails its
checks; not a trainmon exporter's state file; written by a later version; reading failed."""

log = logging.getLogger("trainmon_exporter.state")

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class StateFileError(Exception):
    """The state file is refused: ``reason`` (one of :data:`REFUSALS`) and a one-line message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def read(path: Path) -> dict[str, Any] | None:
    """The state file's object (its ``format`` and ``version`` checked), or None: no file.

    Raises:
        StateFileError: the file is refused (see :data:`REFUSALS`).
    """
    try:
        fd = os.open(path, _FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: a symbolic link
            raise StateFileError(
                "unsafe", f"state file {path} is a symbolic link; remove it (not followed)"
            ) from None
        raise StateFileError("unreadable", f"cannot open state file {path}: {exc}") from None
    try:
        st = os.fstat(fd)
        trusted = {0, os.geteuid()}
        if not stat.S_ISREG(st.st_mode):
            raise StateFileError("unsafe", f"state file {path} is not a regular file")
        if st.st_uid not in trusted or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StateFileError(
                "unsafe",
                f"state file {path} belongs to uid {st.st_uid} with mode "
                f"{stat.S_IMODE(st.st_mode):04o}: only root or this exporter's user may write "
                "it; remove it",
            )
        if st.st_size > MAX_STATE_BYTES:
            raise StateFileError(
                "too_large",
                f"state file {path} holds {st.st_size} bytes (at most "
                f"{MAX_STATE_BYTES}); remove it",
            )
        chunks = []
        left = MAX_STATE_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise StateFileError("unreadable", f"cannot read state file {path}: {exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_STATE_BYTES:
        raise StateFileError("too_large", f"state file {path} grew past {MAX_STATE_BYTES} bytes")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise StateFileError("corrupt", f"state file {path} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateFileError(
            "foreign",
            f"{path} is not a trainmon exporter's state file (no format {FORMAT!r}); "
            "point --state-file at a file of its own",
        )
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise StateFileError("corrupt", f"state file {path} has version {version!r}")
    if version > VERSION:
        raise StateFileError(
            "future_version",
            f"state file {path} was written by a later exporter (version {version}, this one "
            f"reads {VERSION}); its records are not read",
        )
    return doc


def set_aside(path: Path) -> Path | None:
    """Rename a refused state file to ``<name>.refused``; the new name, or None.

    An older ``.refused`` file is replaced. The next save then does not overwrite the evidence.
    None: it could not be moved.
    """
    aside = path.with_name(path.name + ".refused")
    try:
        os.replace(path, aside)
    except OSError:
        return None
    return aside


def write(path: Path, doc: dict[str, Any]) -> int:
    """Write ``doc`` to ``path`` atomically (module docstring); returns the bytes written.

    Raises:
        OSError: the directory cannot be created or written, or the disk is full.
        ValueError: ``doc`` is larger than :data:`MAX_STATE_BYTES` as JSON.
    """
    data = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_STATE_BYTES:
        raise ValueError(f"state of {len(data)} bytes is over {MAX_STATE_BYTES}")
    parent = path.parent
    with contextlib.suppress(FileExistsError):
        parent.mkdir(mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return len(data)


class Keeper:
    """Reads the state file into a store at start and writes the store's rows to it.

    ``check_hello``: the checks a HELLO passes on the wire (the rows' HELLOs pass them too;
    see :func:`trainmon_exporter.state.ledger.parse_row`). What became of the file is counted
    in the store's :attr:`~trainmon_exporter.state.store.Store.file_stats`.
    """

    def __init__(
        self,
        store: Store,
        path: Path,
        check_hello: Callable[[Mapping[str, Any]], dict[str, Any]],
        version: str = "",
    ) -> None:
        self.store = store
        self.path = path
        self.check_hello = check_hello
        self.version = version
        self._write_lock = threading.Lock()

    def load(self) -> None:
        """Restore the rows of the state file; a refused file is logged, counted, set aside."""
        stats = self.store.file_stats
        try:
            doc = read(self.path)
        except StateFileError as exc:
            stats.refused[exc.reason] = stats.refused.get(exc.reason, 0) + 1
            aside = set_aside(self.path) if exc.reason != "unsafe" else None
            where = f"; moved to {aside}" if aside is not None else ""
            log.error("%s: starting without its records%s", exc, where)
            return
        if doc is None:
            log.info("no state file at %s yet: starting afresh", self.path)
            return
        now = time.monotonic()
        offset = time.time() - now
        rows: list[Row] = []
        bad = 0
        first_problem = ""
        most = self.store.admission.max_ranks  # what the store and its ledger hold, each
        for part in ("ranks", "departed"):
            items = doc.get(part, [])
            if not isinstance(items, list):
                items, bad = [], bad + 1
                first_problem = first_problem or f"{part} is not a list"
            if len(items) > most:
                bad += len(items) - most
                first_problem = first_problem or f"{len(items)} {part}, more than max_ranks"
                items = items[:most]
            for item in items:
                try:
                    row = parse_row(item, offset, now, self.check_hello)
                except (ValueError, TypeError) as exc:
                    bad += 1
                    first_problem = first_problem or str(exc)
                    continue
                if (row.departed_ago is None) != (part == "ranks"):
                    bad += 1
                    first_problem = first_problem or f"a row of {part} is not one"
                    continue
                rows.append(row)
        if bad:
            stats.refused["bad_row"] = stats.refused.get("bad_row", 0) + bad
            log.error(
                "state file %s: %d row(s) refused (first: %s); the others are restored",
                self.path,
                bad,
                ascii(first_problem)[:200],
            )
        live, gone = self.restore(rows)
        stats.restored_ranks, stats.restored_departed = live, gone
        saved_at = doc.get("saved_at")
        age = ""
        if isinstance(saved_at, int | float) and _is_time(saved_at):
            age = f", written {time.time() - saved_at:.1f} s ago"
        log.info(
            "state file %s: %d rank(s) and %d departed record(s) restored%s",
            self.path,
            live,
            gone,
            age,
        )

    def restore(self, rows: Iterable[Row]) -> tuple[int, int]:
        """Give the rows back to the store: ``(ranks, departed records)`` restored.

        A live rank comes back disconnected (its connection ended with the exporter that
        wrote the file), its accounting detached: the same process reconnecting goes on where
        it was, and what it reports places the time the exporter was down. It is admitted
        like a new rank (one the node's caps do not hold goes to the ledger), expires after
        the TTL from now, and keeps its run's owner. A departed record keeps its age.
        """
        store = self.store
        n_live = n_gone = 0
        with store.lock:
            now = time.monotonic()
            for row in rows:
                if row.departed_ago is None:
                    state = restored_state(row, store.buckets, RankAnalytics(store.analytics), now)
                    if store.admit_restored(state, now):
                        n_live += 1
                        continue
                if row.key in store.ranks:
                    continue  # one record a rank: its live state holds its accounting
                row.goodput.closed(now)
                store.ledger.put(
                    Departed(
                        hello=row.hello,
                        owner_uid=row.owner_uid,
                        tenant=tenant_of(row.owner_namespace, row.owner_uid),
                        status=row.status,
                        step=row.step,
                        steps_total=row.steps_total,
                        goodput=row.goodput,
                        since=now - (row.departed_ago or 0.0),
                    )
                )
                n_gone += 1
            store.ledger.sort()
        return n_live, n_gone

    def rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The rows to write: ``(live ranks, departed records)``, under the store's lock."""
        store = self.store
        with store.lock:
            now = time.monotonic()
            offset = time.time() - now
            live = [rank_row(s, offset) for s in store.ranks.values() if not s.revoked]
            gone = [departed_row(d, offset, now) for d in store.ledger]
        return live, gone

    def save(self) -> bool:
        """Write the store's rows (one writer at a time); False (logged, counted) on error."""
        live, gone = self.rows()
        saved_at = time.time()
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "saved_at": saved_at,
            "exporter": self.version,
            "ranks": live,
            "departed": gone,
        }
        stats = self.store.file_stats
        with self._write_lock:
            try:
                write(self.path, doc)
            except (OSError, ValueError) as exc:
                stats.save_errors += 1
                log.error("cannot write state file %s: %s", self.path, exc)
                return False
            stats.saves_ok += 1
            stats.last_save = saved_at
        return True


def _is_time(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
