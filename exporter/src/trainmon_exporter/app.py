"""The FastAPI application: ``/metrics``, health probes, the JSON API and the status page.

Everything with a lifetime (the ingest socket, the expiry sweeper) starts and stops in the
lifespan. ``/metrics`` is a sync route, so Starlette runs it in its threadpool and collection
never blocks the event loop that serves ingest.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.exposition import choose_encoder

from trainmon_exporter import __version__
from trainmon_exporter.api import RunsResponse, snapshot
from trainmon_exporter.collectors import CollectorContext, ScrapeCollector, build_collectors
from trainmon_exporter.ingest import IngestMetrics, IngestServer
from trainmon_exporter.settings import Settings
from trainmon_exporter.state import Store

log = logging.getLogger("trainmon_exporter")


@dataclass
class Exporter:
    """The objects one app owns, reachable as ``app.state.exporter``."""

    settings: Settings
    store: Store
    registry: CollectorRegistry
    ingest: IngestServer
    scrape: ScrapeCollector
    started: float


def build_exporter(settings: Settings) -> Exporter:
    """Wire the store, registry, collectors and ingest server (nothing starts yet)."""
    disable_created_metrics()  # type: ignore[no-untyped-call] # no *_created series: they double the exposition for nothing
    store = Store(
        analytics=settings.analytics,
        max_ranks=settings.max_ranks,
        max_custom_metrics=settings.max_custom_metrics,
        max_layers=settings.max_layers,
        buckets=settings.step_duration_buckets,
        window_s=settings.rate_window_seconds,
        ttl_s=settings.series_ttl_seconds,
    )
    registry = CollectorRegistry(auto_describe=False)
    metrics = IngestMetrics(registry)
    scrape = ScrapeCollector(build_collectors(CollectorContext(settings, store)))
    registry.register(scrape)  # type: ignore[arg-type]
    ingest = IngestServer(
        settings.socket,
        store,
        metrics,
        settings.socket_permissions,
        settings.ingest_poll_interval_seconds,
    )
    return Exporter(settings, store, registry, ingest, scrape, time.time())


async def _sweep(store: Store) -> None:
    period = min(5.0, max(0.05, store.ttl_s / 4))
    while True:
        await asyncio.sleep(period)
        n = store.expire()
        if n:
            log.info("expired %d disconnected rank(s)", n)


async def _watch_conditions(store: Store, period: float = 0.1, rates_every: int = 10) -> None:
    """Judge hangs every ``period`` s, throughput drops and stragglers every ``rates_every``."""
    tick = 0
    while True:
        await asyncio.sleep(period)
        tick += 1
        for s, kind in store.check_conditions(time.time(), rates=tick % rates_every == 0):
            log.warning("run %s rank %d: %s detected at step %s", s.run, s.rank, kind, s.step)


def create_app(settings: Settings) -> FastAPI:
    """Build the exporter's ASGI app from ``settings``.

    Raises (at startup, from the lifespan): :class:`~trainmon_exporter.ingest.SocketInUseError`
    or ``OSError`` when the ingest socket cannot be created.
    """
    ex = build_exporter(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ex.ingest.start()
        tasks = [
            asyncio.create_task(_sweep(ex.store)),
            asyncio.create_task(_watch_conditions(ex.store)),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            ex.ingest.close()
            log.info("ingest socket closed and removed")

    app = FastAPI(
        title="trainmon exporter",
        version=__version__,
        lifespan=lifespan,
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.exporter = ex

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        """Prometheus exposition (text 0.0.4, or OpenMetrics when asked for)."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(ex.registry), media_type=content_type)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """Liveness: the process answers HTTP."""
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """Readiness: 200 once the ingest socket listens; lists collector health."""
        ready = ex.ingest.listening
        body = {
            "status": "ready" if ready else "not ready",
            "socket": str(settings.socket),
            "collectors": ex.scrape.last_success,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/api/v1/runs", response_model=RunsResponse)
    def runs() -> RunsResponse:
        """Every run and rank the exporter knows, with last values and health."""
        return snapshot(ex.store)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def status_page() -> str:
        """A small human-readable status page (refreshes every 5 s)."""
        return render_status(snapshot(ex.store), ex)

    return app


def _f(v: float | None, fmt: str = ".4g") -> str:
    return "–" if v is None else format(v, fmt)


def _value(values: dict[str, float | None], key: str, fmt: str) -> str:
    """A logged value; reported-but-null means it was NaN or infinite (JSON has neither)."""
    if key in values and values[key] is None:
        return "NaN/Inf"
    return _f(values.get(key), fmt)


def _scale(v: float | None, k: float) -> float | None:
    return None if v is None else v * k


def render_status(data: RunsResponse, ex: Exporter) -> str:
    """HTML for ``/``: every value escaped (run ids and names come from clients)."""
    e = html.escape
    rows = []
    for run in data.runs:
        for r in run.ranks:
            health = "; ".join(r.health) or "ok"
            if r.events:
                last = r.events[-1]
                times = f" x{last.count} to step {last.last_step}" if last.count > 1 else ""
                health += f" · last event: {last.kind} at step {last.step}{times}"
            rows.append(
                "<tr>"
                f"<td>{e(run.run)}</td><td>{r.rank}/{r.world_size}</td>"
                f"<td>{e(r.hostname)}</td>"
                f"<td class='{e(r.status)}'>{e(r.status)}</td>"
                f"<td>{'' if r.step is None else r.step}</td>"
                f"<td>{_value(r.values, 'loss', '.4g')}</td>"
                f"<td>{_value(r.values, 'lr', '.3g')}</td>"
                f"<td>{_value(r.values, 'grad_norm', '.3g')}</td>"
                f"<td>{_f(r.tokens_per_second, ',.0f')}</td>"
                f"<td>{_f(_scale(r.step_time_mean_seconds, 1e3), '.1f')}</td>"
                f"<td>{_f(_scale(r.client_overhead_ratio, 100), '.3f')}</td>"
                f"<td>{_f(r.seconds_since_last_step, '.1f')}</td>"
                f"<td>{e(health)}</td>"
                "</tr>"
            )
    body = "\n".join(rows) or "<tr><td colspan='13'>No trainer has connected yet.</td></tr>"
    collectors = (
        ", ".join(f"{e(k)}: {'ok' if v else 'FAILING'}" for k, v in ex.scrape.last_success.items())
        or "not scraped yet"
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="5">
<title>trainmon exporter</title>
<style>
body{{font-family:system-ui,sans-serif;margin:1.5em;color:#222}}
table{{border-collapse:collapse}}
td,th{{padding:.3em .7em;border-bottom:1px solid #ddd;text-align:right}}
td:first-child,th:first-child,td:nth-child(3),td:nth-child(4),td:last-child{{text-align:left}}
.crashed,.failed{{color:#b00;font-weight:bold}} .running{{color:#070}} .finished{{color:#555}}
</style></head><body>
<h1>trainmon exporter {e(__version__)}</h1>
<p>Ingest socket <code>{e(str(ex.settings.socket))}</code>:
{"listening" if ex.ingest.listening else "NOT listening"} ·
collectors: {collectors} ·
<a href="/metrics">/metrics</a> · <a href="/api/v1/runs">/api/v1/runs</a> ·
<a href="/docs">API docs</a></p>
<table><thead><tr><th>run</th><th>rank</th><th>host</th><th>status</th><th>step</th>
<th>loss</th><th>lr</th><th>grad norm</th><th>tokens/s</th><th>step ms</th>
<th>client overhead %</th><th>s since step</th><th>health</th></tr></thead>
<tbody>
{body}
</tbody></table></body></html>"""
