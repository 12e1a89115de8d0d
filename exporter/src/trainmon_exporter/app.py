"""The FastAPI application: ``/metrics``, health probes, the JSON API and the status page.

This module only wires: :func:`build_exporter` connects the store, registry, collectors, GPU
sampler and ingest server; :func:`create_app` adds the lifespan and the routes. What the JSON
API and the status page show is built in :mod:`trainmon_exporter.views`.

Everything with a lifetime (the ingest socket, the GPU sampler, and the expiry sweeper, the
detector clock and the state file's saves of :mod:`trainmon_exporter.timers`) starts and stops
in the lifespan. ``/metrics`` is an async route that renders
in a worker thread, so collection never blocks the event loop that serves ingest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, disable_created_metrics

from trainmon_exporter import __version__, derive
from trainmon_exporter.apply import checked_hello
from trainmon_exporter.claims import OwnerClaims
from trainmon_exporter.collectors import CollectorContext, ScrapeCollector, build_collectors
from trainmon_exporter.exposition import TextExposition
from trainmon_exporter.httplimits import GatedResponse, HttpStats, RequestGate
from trainmon_exporter.ingest import IngestMetrics, IngestServer, connection_cap
from trainmon_exporter.logsetup import LogMetrics, report_pending
from trainmon_exporter.nvml import NvmlBackend, PynvmlBackend
from trainmon_exporter.peers import PeerResolver, PodDirectory
from trainmon_exporter.sampler import FAILED, NOT_STARTED, GpuSampler, GpuSnapshot
from trainmon_exporter.scrapes import SharedScrapes, scrape_format
from trainmon_exporter.settings import Settings
from trainmon_exporter.shed import SampleBudget
from trainmon_exporter.sockfile import IngestSocket
from trainmon_exporter.state.evidence import GpuEvidence
from trainmon_exporter.state.statefile import Keeper
from trainmon_exporter.state.store import Store
from trainmon_exporter.timers import keep, sweep, watch_conditions
from trainmon_exporter.views.api import GpusResponse, RunsResponse, gpu_snapshot, snapshot
from trainmon_exporter.views.html import StatusPage, render_status
from trainmon_exporter.views.jobs import JobSource, source_of
from trainmon_exporter.views.remote import PLAIN, StatusError, access, with_peers
from trainmon_exporter.webconfig import (
    AuthStats,
    TlsStats,
    WebConfig,
    WebMiddleware,
    load_web_config,
    middleware_options,
)

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
    gpus: GpuSampler | None = None
    http_stats: HttpStats | None = None
    scrapes: SharedScrapes | None = None
    api_gate: RequestGate | None = None
    auth_stats: AuthStats | None = None
    tls_stats: TlsStats | None = None
    keeper: Keeper | None = None
    jobs: JobSource | None = None


class GpusRequiredError(RuntimeError):
    """``require_gpus`` is set and NVML cannot be used."""


def build_exporter(
    settings: Settings, nvml: NvmlBackend | None = None, listener: IngestSocket | None = None
) -> Exporter:
    """Wire the store, registry, collectors, GPU sampler and ingest server (nothing starts).

    ``nvml`` replaces the real NVML backend (tests pass a fake); ``listener`` is an ingest
    socket already created (the CLI's), else the ingest server creates it when it starts.
    """
    disable_created_metrics()  # type: ignore[no-untyped-call] # no *_created series: they double the exposition for nothing
    store = Store(
        analytics=settings.analytics,
        max_ranks=settings.max_ranks,
        max_custom_metrics=settings.max_custom_metrics,
        max_layers=settings.max_layers,
        layer_ranks=settings.layer_rank_set,
        buckets=settings.step_duration_buckets,
        window_s=settings.rate_window_seconds,
        ttl_s=settings.series_ttl_seconds,
        max_series=settings.max_series,
        max_operations=settings.max_operations,
        max_ranks_per_uid=settings.max_ranks_per_uid,
        max_series_per_uid=settings.max_series_per_uid,
        retention_s=settings.rank_retention_seconds,
        default_namespace=settings.default_namespace or "",
        goodput_retention_s=settings.goodput_retention_seconds,
        capture_max_bytes=settings.hang_capture_max_bytes,
        evidence_max_bytes=settings.hang_evidence_max_bytes,
    )
    if settings.owner_claims_dir is not None:
        store.claims = OwnerClaims(settings.owner_claims_dir)
    keeper = None
    if settings.state_path is not None:
        keeper = Keeper(store, settings.state_path, checked_hello, __version__)
    registry = CollectorRegistry(auto_describe=False)
    metrics = IngestMetrics(registry)
    registry.register(LogMetrics())  # type: ignore[arg-type]
    http_stats = HttpStats()
    registry.register(http_stats)  # type: ignore[arg-type]
    auth_stats = AuthStats()
    registry.register(auth_stats)  # type: ignore[arg-type]
    tls_stats = TlsStats()
    registry.register(tls_stats)  # type: ignore[arg-type]
    gpus = None
    if settings.collectors.gpu or settings.collectors.rank_gpu:
        gpus = GpuSampler(
            nvml if nvml is not None else PynvmlBackend(),
            interval=settings.nvml_interval_seconds,
            processes=settings.nvml_processes,
            require=settings.require_gpus,
            slow_interval=settings.nvml_slow_interval_seconds,
        )
    if gpus is not None:
        sampler = gpus

        def probe(uuid: str) -> GpuEvidence | None:
            g = sampler.snapshot.by_uuid().get(uuid)
            return derive.gpu_evidence(None if g is None else g.readings)

        store.hangs.gpu_probe = probe
    scrape = ScrapeCollector(build_collectors(CollectorContext(settings, store, gpus)))
    registry.register(scrape)  # type: ignore[arg-type]
    cap = connection_cap(settings.ingest_max_connections, settings.http_limit_concurrency)
    peers = None
    if settings.kubelet_pod_logs_dir is not None:
        peers = PeerResolver(PodDirectory(settings.kubelet_pod_logs_dir))
    ingest = IngestServer(
        settings.socket,
        store,
        metrics,
        settings.socket_permissions,
        settings.ingest_poll_interval_seconds,
        group=settings.socket_gid,
        allowed_uids=settings.allowed_uids,
        allowed_gids=settings.allowed_gids,
        listener=listener,
        max_connections=cap,
        max_connections_per_uid=settings.connections_per_uid(cap),
        hello_timeout=settings.ingest_hello_timeout_seconds,
        idle_timeout=settings.ingest_idle_timeout_seconds,
        max_bytes_per_second=settings.ingest_max_bytes_per_second,
        peers=peers,
    )
    scrapes = SharedScrapes(settings.http_max_concurrent_scrapes, http_stats)
    api_gate = RequestGate(settings.http_max_concurrent_api, http_stats, "api_limit")
    return Exporter(
        settings,
        store,
        registry,
        ingest,
        scrape,
        time.time(),
        gpus,
        http_stats,
        scrapes,
        api_gate,
        auth_stats,
        tls_stats,
        keeper,
        source_of(settings.prometheus_url),
    )


def runs_of(ex: Exporter, gpus: GpuSnapshot | None = None) -> RunsResponse:
    """The body of ``/api/v1/runs``: the store's runs (each job's figures too, if set up)."""
    runs = snapshot(ex.store, _gpus(ex) if gpus is None else gpus, ex.settings.peak_flops)
    return runs if ex.jobs is None else ex.jobs.add_to(runs)


def create_app(
    settings: Settings,
    nvml: NvmlBackend | None = None,
    *,
    listener: IngestSocket | None = None,
    web: WebConfig | None = None,
) -> FastAPI:
    """Build the exporter's ASGI app from ``settings``.

    ``nvml`` and ``listener``: see :func:`build_exporter`. ``web``: the web configuration
    already loaded (the CLI's), else it is read from ``settings.web_config_file`` if set
    (raises :class:`~trainmon_exporter.webconfig.WebConfigError`); its basic auth and headers
    wrap every route. TLS is the server's part (``WebConfig.ssl_context``).

    Raises (at startup, from the lifespan, when no ``listener`` is given):
    :class:`~trainmon_exporter.sockfile.SocketSetupError` when the ingest socket cannot be
    created; :class:`GpusRequiredError` when ``require_gpus`` is set and NVML is unusable.
    """
    ex = build_exporter(settings, nvml, listener)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if ex.gpus is not None:
            if settings.require_gpus:
                if not ex.gpus.open():
                    snap = ex.gpus.snapshot
                    raise GpusRequiredError(
                        f"require_gpus is set but {snap.error}"
                        + (f". HINT: {snap.hint}" if snap.hint else "")
                    )
                if not ex.gpus.sample_once().gpus:
                    ex.gpus.stop()
                    raise GpusRequiredError("require_gpus is set but NVML sees no GPU")
            ex.gpus.start()
        if ex.keeper is not None:
            ex.keeper.load()  # before the first trainer connects
        ex.ingest.start()
        tasks = [
            asyncio.create_task(sweep(ex.store)),
            asyncio.create_task(watch_conditions(ex, native=settings.hang_native_stacks)),
        ]
        if ex.keeper is not None:
            tasks.append(asyncio.create_task(keep(ex.keeper, settings.state_save_interval_seconds)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            ex.ingest.close()
            log.info("ingest socket closed and removed")
            if ex.keeper is not None and ex.keeper.save():
                log.info("state file %s written", ex.keeper.path)
            report_pending(log)
            if ex.gpus is not None:
                ex.gpus.stop()

    app = FastAPI(
        title="trainmon exporter",
        version=__version__,
        lifespan=lifespan,
        # Swagger UI and ReDoc load their scripts from a CDN, so they are blank offline (most
        # training clusters): no /docs page; the schema itself is served at /openapi.json.
        docs_url=None,
        redoc_url=None,
    )
    app.state.exporter = ex

    scrapes = ex.scrapes
    assert scrapes is not None
    text = TextExposition()
    text_lock = threading.Lock()
    budget = SampleBudget(ex.registry, settings.scrape_sample_limit)
    app.state.sample_budget = budget

    def render_text(registry: Any) -> bytes:
        with text_lock:  # one cache: concurrent scrapes take turns formatting
            return text.render(registry)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        """Prometheus exposition (text 0.0.4, or OpenMetrics when asked for).

        Never refused: collected in a worker thread, one collection at a time, shared by
        every scrape that arrived while the previous one ran; at most
        ``http_max_concurrent_scrapes`` distinct bodies kept for clients still reading
        (:class:`SharedScrapes`); never more than ``scrape_sample_limit`` samples
        (:class:`SampleBudget` sheds the least important series first). The text format
        comes from :class:`TextExposition` (prometheus-client's bytes, each series' label text
        kept between scrapes); OpenMetrics from prometheus-client.
        """
        key, content_type, encoder = scrape_format(request.headers.get("accept", ""))
        encode = render_text if encoder is None else encoder
        return await scrapes.response(key, lambda: encode(budget), content_type, request.scope)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers HTTP (on the event loop: no worker thread needed)."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Readiness: 200 while the ingest socket listens *and* its path still leads to it.

        503 with ``reason`` when the socket is not listening, or its file was deleted or
        replaced (trainers connecting to the path would not reach this exporter). Lists
        collector health either way.
        """
        problem = ex.ingest.socket_problem()
        ready = problem is None
        body = {
            "status": "ready" if ready else "not ready",
            "reason": problem,
            "socket": str(settings.socket),
            "collectors": ex.scrape.last_success,
            "collector_errors": ex.scrape.last_error,
            "gpus": _gpu_status(ex),
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    api_gate = ex.api_gate
    assert api_gate is not None
    builder: list[anyio.CapacityLimiter] = []  # made on first use, inside the event loop

    async def gated(build: Callable[[], bytes], media_type: str) -> Response:
        """Build a body in a worker thread under the API gate (503 when it is full)."""
        assert api_gate is not None
        if not api_gate.enter():
            return PlainTextResponse(
                "too many concurrent API requests (http_max_concurrent_api)\n",
                status_code=503,
                headers={"Retry-After": "1"},
            )
        try:
            if not builder:
                # One body built at a time (the GIL runs one anyway): one worker thread's
                # allocator arena holds the garbage of a build, not one per concurrent request.
                builder.append(anyio.CapacityLimiter(1))
            body = await anyio.to_thread.run_sync(build, limiter=builder[0])
        except BaseException:
            api_gate.leave()
            raise
        return GatedResponse(api_gate, body, media_type=media_type)

    @app.get("/api/v1/runs", response_model=RunsResponse)
    async def runs() -> Response:
        """Every run and rank the exporter knows, with last values, health and MFU.

        Built in a worker thread; at most ``http_max_concurrent_api`` API and status-page
        requests at once (503 past it), each holding its slot until its body is written.
        """
        return await gated(
            lambda: runs_of(ex).model_dump_json().encode(),
            "application/json",
        )

    @app.get("/api/v1/gpus", response_model=GpusResponse)
    async def gpus() -> Response:
        """Every GPU of the node from the last NVML sample, or why there is none."""
        return await gated(
            lambda: gpu_snapshot(_gpus(ex)).model_dump_json().encode(), "application/json"
        )

    def status_body() -> bytes:
        gpus = _gpus(ex)
        runs = runs_of(ex, gpus)
        problems: list[str] = []
        try:
            how = access(
                settings.status_peer_ca_file,
                settings.status_peer_user,
                settings.status_peer_password_file,
                {},
            )
        except StatusError as exc:
            how, problems = PLAIN, [f"status peers: {exc}"]
        peers = settings.status_peers if not problems else ()
        hangs, unread = with_peers(runs, peers, how)
        page = StatusPage(
            runs=runs,
            gpus=gpu_snapshot(gpus),
            socket=str(settings.socket),
            socket_problem=ex.ingest.socket_problem(),
            collectors=dict(ex.scrape.last_success),
            gpu_state=None if ex.gpus is None else gpus.state,
            hangs=hangs,
            peer_problems=problems + unread,
        )
        return render_status(page).encode()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def status_page() -> Response:
        """A small human-readable status page (refreshes every 5 s; gated like the API)."""
        return await gated(status_body, "text/html; charset=utf-8")

    if web is None and settings.web_config_file is not None:
        web = load_web_config(settings.web_config_file)
    if web is not None:
        assert ex.auth_stats is not None
        options = middleware_options(web, ex.auth_stats, settings.http_max_concurrent_auth_checks)
        if options:  # added last: the outermost layer, before any route or limit
            app.add_middleware(WebMiddleware, **options)
    return app


def _gpus(ex: Exporter) -> GpuSnapshot:
    return ex.gpus.snapshot if ex.gpus is not None else NOT_STARTED


def _gpu_status(ex: Exporter) -> dict[str, object]:
    """GPU sampling state for ``/readyz`` (readiness never depends on it).

    ``state``: ``sampling``, ``no_driver`` (no NVIDIA library or driver and no GPU expected:
    a node without GPUs, not a problem), ``failed`` (GPUs expected, NVML unusable) or
    ``starting``. ``ok`` is false only for ``failed``; ``expected`` says whether this node
    should have GPU metrics.
    """
    if ex.gpus is None:
        return {"enabled": False}
    snap = ex.gpus.snapshot
    return {
        "enabled": True,
        "state": snap.state,
        "ok": snap.state != FAILED,
        "expected": snap.expected,
        "count": len(snap.gpus),
        "lost": snap.lost_total,
        "error": snap.error,
        "hint": snap.hint,
    }
