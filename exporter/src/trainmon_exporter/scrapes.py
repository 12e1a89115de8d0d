"""``/metrics`` for every scraper: shared collections, no slot to hold, bounded bodies.

:class:`SharedScrapes` answers every scrape with a collection that started after it arrived,
one collection at a time, shared by every scrape that waited for it; the bodies kept for
clients still reading are bounded, the one read least recently closed first. Why this design,
and the options not taken: docs/exporter.md, Scrapes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
from prometheus_client import exposition
from prometheus_client.openmetrics import exposition as openmetrics
from starlette.responses import Response
from starlette.types import Scope

from trainmon_exporter.httplimits import CONNECTION, AbortFn, ChunkedResponse, HttpStats


def scrape_format(accept: str) -> tuple[Hashable, str, Callable[[Any], bytes] | None]:
    """What an ``Accept`` header asks of ``/metrics``: ``(key, content_type, encoder)``.

    ``encoder`` is prometheus-client's for the format, or None for the text format 0.0.4 (the
    caller's own, :class:`~trainmon_exporter.exposition.TextExposition`). Requests with the
    same ``key`` get the same bytes and may share one collection: the format and the name
    escaping decide the bytes, not the OpenMetrics version string (echoed in the content
    type; trainmon exports no native histograms, the only part it changes), so the keys are
    few (at most 9) whatever clients send.
    """
    encoder, content_type = exposition.choose_encoder(accept)
    if encoder is exposition.generate_latest:
        return "text", content_type, None
    if isinstance(encoder, partial):
        escaping = encoder.keywords.get("escaping", openmetrics.UNDERSCORES)
        kind = "openmetrics" if encoder.func is not exposition.generate_latest else "text-1"
        return (kind, escaping), content_type, partial(encoder.func, escaping=escaping)
    return content_type, content_type, encoder  # pragma: no cover - a newer prometheus-client


class Delivery:
    """One ``/metrics`` response: the body it was given, and when it last made progress."""

    __slots__ = ("abort", "evicted", "held", "progress", "ready")

    def __init__(self, ready: asyncio.Future[None], abort: AbortFn | None) -> None:
        self.ready = ready  # done when a collection gave this request its body
        self.abort = abort
        self.held: _Held | None = None
        self.progress = 0.0  # loop time of the last piece handed to the transport
        self.evicted = False


class _Held:
    """A body and the deliveries still sending it."""

    __slots__ = ("data", "deliveries")

    def __init__(self, data: bytes, deliveries: set[Delivery]) -> None:
        self.data = data
        self.deliveries = deliveries


class _Flight:
    """The collection of one key in progress and the requests it answers.

    ``queued``: the requests that arrived after it started; they get the next one.
    """

    __slots__ = ("current", "queued", "task")

    def __init__(self, first: Delivery) -> None:
        self.current = [first]
        self.queued: list[Delivery] = []
        self.task: asyncio.Task[None] | None = None


class SharedScrapes:
    """``/metrics`` answered by shared collections, bodies kept for at most ``limit`` at once.

    - **One collection at a time, shared.** A request waits for the next collection of its
      format to *start*, so it never gets data collected before it arrived; every request that
      arrived while one collection ran shares the next. Collections run one at a time in a
      worker thread (the GIL runs one anyway), so CPU and the memory a collection builds are
      bounded whatever the number of clients, and no client holds a slot: nothing a client
      does or fails to do (never reading its answer) keeps another scrape out.
    - **Bodies held for readers are bounded.** A body stays in memory while a response still
      sends it. When a new body would make more than ``limit`` distinct bodies held, the
      response that has gone longest without handing a piece to its client is closed
      (``trainmon_http_connections_closed_total{reason="unread"}``), repeatedly, until one
      body is freed; one that is being read makes progress and goes last.

    Use from the event loop's thread only.
    """

    def __init__(self, limit: int, stats: HttpStats) -> None:
        self.limit = limit
        self.stats = stats
        self.collections = 0  # bodies made
        self._flights: dict[Hashable, _Flight] = {}
        self._held: set[_Held] = set()
        self._limiter: anyio.CapacityLimiter | None = None  # made inside the event loop

    @property
    def held(self) -> int:
        """Distinct bodies held for responses in progress."""
        return len(self._held)

    async def response(
        self, key: Hashable, render: Callable[[], bytes], content_type: str, scope: Scope
    ) -> Response:
        """The response to one request: its body from the next collection of ``key``.

        ``render`` makes the body (run in a worker thread; every request of one key must pass
        an equivalent one). Raises what ``render`` raises.
        """
        loop = asyncio.get_running_loop()
        abort = scope.get("extensions", {}).get(CONNECTION, {}).get("abort")
        d = Delivery(loop.create_future(), abort)
        flight = self._flights.get(key)
        if flight is None:
            flight = self._flights[key] = _Flight(d)
            flight.task = loop.create_task(self._fly(key, flight, render))
        else:
            flight.queued.append(d)
        try:
            await d.ready
        except BaseException:
            self.release(d)
            raise
        if d.held is None:  # closed for a newer body before it could start: nobody reads this
            return Response(status_code=503, headers={"Retry-After": "1"})
        return _SharedBodyResponse(self, d, d.held.data, media_type=content_type)

    async def _fly(self, key: Hashable, flight: _Flight, render: Callable[[], bytes]) -> None:
        try:
            while flight.current:
                if self._limiter is None:
                    self._limiter = anyio.CapacityLimiter(1)
                try:
                    body = await anyio.to_thread.run_sync(render, limiter=self._limiter)
                except Exception as exc:
                    for d in flight.current:
                        if not d.ready.done():
                            d.ready.set_exception(exc)
                else:
                    self.collections += 1
                    self._hand_out(body, flight.current)
                flight.current, flight.queued = flight.queued, []
        finally:
            del self._flights[key]
            for d in flight.current + flight.queued:  # cancelled (the server stops)
                if not d.ready.done():
                    d.ready.cancel()

    def _hand_out(self, body: bytes, deliveries: list[Delivery]) -> None:
        waiting = [d for d in deliveries if not d.ready.done()]
        if not waiting:
            return
        held = _Held(body, set(waiting))
        self._held.add(held)
        now = asyncio.get_running_loop().time()
        for d in waiting:
            d.held = held
            d.progress = now
            d.ready.set_result(None)
        self._make_room(held)

    def _make_room(self, new: _Held) -> None:
        """Close responses of older bodies until at most ``limit`` bodies are held.

        The one that has gone longest without handing a piece to its client goes first.
        """
        if len(self._held) <= self.limit:
            return
        others = sorted(
            (d for h in self._held if h is not new for d in h.deliveries),
            key=lambda d: d.progress,
        )
        for d in others:
            if len(self._held) <= self.limit:
                break
            self.release(d)
            d.evicted = True
            if d.abort is not None:
                d.abort("unread")
            else:  # another server: the response stops at its next piece
                self.stats.close("unread")

    def release(self, d: Delivery) -> None:
        """``d`` no longer sends its body (done, closed, or the request went away)."""
        held, d.held = d.held, None
        if held is not None:
            held.deliveries.discard(d)
            if not held.deliveries:
                self._held.discard(held)


class _SharedBodyResponse(ChunkedResponse):
    def __init__(self, scrapes: SharedScrapes, delivery: Delivery, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.scrapes = scrapes
        self.delivery = delivery

    def stopped(self) -> bool:
        return self.delivery.evicted

    def sent(self) -> None:
        self.delivery.progress = asyncio.get_running_loop().time()

    def done(self) -> None:
        self.scrapes.release(self.delivery)
