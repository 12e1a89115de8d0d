"""The exporter's periodic work, started and stopped in the app's lifespan.

The expiry sweep (:func:`sweep`: ranks past ``series_ttl_seconds``), the detector clock
(:func:`watch_conditions`: hangs every 0.1 s, rates every 1 s, and a hung rank asked for its
stacks at once, :func:`ask_hung`, docs/hangs.md), and the state file's saves (:func:`keep`).
Each is a coroutine on the event loop that serves ingest, so it never blocks: the disk and
py-spy are reached in worker threads. :mod:`trainmon_exporter.app` wires them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import anyio.to_thread

from trainmon_client._protocol import encode_capture_request
from trainmon_exporter.native import py_spy_dump
from trainmon_exporter.settings import Settings
from trainmon_exporter.state.rank import RankState
from trainmon_exporter.state.statefile import Keeper
from trainmon_exporter.state.store import Store

if TYPE_CHECKING:
    from trainmon_exporter.app import Exporter

__all__ = ["ask_hung", "keep", "native_stacks", "sweep", "watch_conditions"]

log = logging.getLogger("trainmon_exporter")


async def keep(keeper: Keeper, period: float) -> None:
    """Write the state file every ``period`` s (in a worker thread: the disk may be slow)."""
    while True:
        await asyncio.sleep(period)
        await anyio.to_thread.run_sync(keeper.save)


async def sweep(store: Store) -> None:
    """Drop the ranks past the TTL, every quarter of it (at most every 5 s)."""
    period = min(5.0, max(0.05, store.ttl_s / 4))
    while True:
        await asyncio.sleep(period)
        n = store.expire()
        if n:
            log.info("expired %d disconnected rank(s)", n)


def ask_hung(ex: Exporter, started: Iterable[tuple[RankState, str]]) -> list[tuple[RankState, int]]:
    """Ask each rank whose hang episode just started for its evidence (``hang_capture``).

    ``started``: the episodes :meth:`Store.check_conditions` returned. A CAPTURE_REQUEST goes
    out on the rank's own connection (docs/hangs.md); one that cannot be sent is ``no_answer``
    at once. Returns the ranks asked, with their request ids.
    """
    asked: list[tuple[RankState, int]] = []
    if not ex.settings.hang_capture:
        return asked
    for s, kind in started:
        if kind != "hang":
            continue
        request_id = ex.store.begin_capture(s)
        packet = encode_capture_request(request_id, ex.settings.hang_capture_max_bytes)
        why = ex.ingest.send_to(s, packet)
        if why is not None:
            ex.store.capture_not_sent(s, f"the request for a capture was not sent: {why}")
        asked.append((s, request_id))
    return asked


async def watch_conditions(
    ex: Exporter, period: float = 0.1, rates_every: int = 10, *, native: bool = False
) -> None:
    """Judge hangs every ``period`` s, throughput drops and stragglers every ``rates_every``.

    A rank judged hung is asked for its evidence at once (:func:`ask_hung`); requests
    unanswered after ``hang_capture_timeout_seconds`` become ``no_answer``. With ``native``,
    py-spy reads the rank's native stacks in a worker thread beside it.
    """
    store, settings = ex.store, ex.settings
    tick = 0
    tasks: set[asyncio.Task[None]] = set()
    while True:
        await asyncio.sleep(period)
        tick += 1
        started = store.check_conditions(rates=tick % rates_every == 0)  # monotonic
        for s, kind in started:
            log.warning("run %s rank %d: %s detected at step %s", s.run, s.rank, kind, s.step)
        for s, request_id in ask_hung(ex, started):
            if native:
                task = asyncio.create_task(native_stacks(store, s, request_id, settings))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        for s in store.expire_captures(settings.hang_capture_timeout_seconds):
            log.warning("run %s rank %d: hung, and its stacks never came", s.run, s.rank)


async def native_stacks(store: Store, s: RankState, request_id: int, settings: Settings) -> None:
    """py-spy's native stacks of a hung rank, read in a worker thread (``hang_native_stacks``)."""
    text, note = await asyncio.to_thread(
        py_spy_dump, s.peer_pid, s.owner_uid, settings.hang_capture_max_bytes
    )
    store.set_native(s, request_id, text, note)
